#include "engine/engine.h"

namespace ts {

RequestStream::RequestStream(std::string id, int32_t prompt_tokens)
    : id_(std::move(id)), prompt_tokens_(prompt_tokens) {
  times_.submitted = RequestTimes::Clock::now();
}

bool RequestStream::Take(StreamUpdate* out) {
  std::lock_guard<std::mutex> lock(mu_);
  if (pending_.tokens.empty() && !pending_.finished) return false;
  *out = std::move(pending_);
  pending_ = StreamUpdate{};
  out->prompt_tokens = prompt_tokens_;
  out->completion_tokens = completion_tokens_;
  out->times = times_;
  return true;
}

void RequestStream::SetNotifier(std::function<void()> notify) {
  bool has_pending;
  {
    std::lock_guard<std::mutex> lock(mu_);
    notify_ = std::move(notify);
    has_pending = !pending_.tokens.empty() || pending_.finished;
  }
  // Data may have arrived before the consumer attached; without this it would wait forever.
  if (has_pending) Notify();
}

void RequestStream::MarkScheduled() {
  std::lock_guard<std::mutex> lock(mu_);
  times_.scheduled = RequestTimes::Clock::now();
}

void RequestStream::Append(std::span<const int32_t> tokens,
                           RequestTimes::Clock::time_point prefill_started) {
  if (tokens.empty()) return;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (done_) return;
    if (times_.first_token == RequestTimes::Clock::time_point{}) {
      times_.first_token = RequestTimes::Clock::now();
      times_.prefill_started = prefill_started;
    }
    pending_.tokens.insert(pending_.tokens.end(), tokens.begin(), tokens.end());
    completion_tokens_ += static_cast<int32_t>(tokens.size());
  }
  Notify();
}

void RequestStream::Finish(FinishReason reason, absl::Status status) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (done_) return;
    done_ = true;
    times_.finished = RequestTimes::Clock::now();
    pending_.finished = true;
    pending_.reason = reason;
    pending_.status = std::move(status);
  }
  Notify();
}

int32_t RequestStream::unread() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int32_t>(pending_.tokens.size());
}

bool RequestStream::finished() const {
  std::lock_guard<std::mutex> lock(mu_);
  return done_;
}

int32_t RequestStream::completion_tokens() const {
  std::lock_guard<std::mutex> lock(mu_);
  return completion_tokens_;
}

RequestTimes RequestStream::times() const {
  std::lock_guard<std::mutex> lock(mu_);
  return times_;
}

void RequestStream::Notify() {
  std::function<void()> notify;
  {
    std::lock_guard<std::mutex> lock(mu_);
    notify = notify_;
  }
  // Called outside the lock so the consumer may Take from inside its notifier.
  if (notify) notify();
}

}  // namespace ts
