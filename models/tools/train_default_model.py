#!/usr/bin/env python3
"""Trains tailserve's small default model: a ~7M-parameter Llama on the King James Bible.

The model exists so that scripts/demo.sh prints a readable English continuation; it is not a
useful assistant. Everything it needs is in one run of this script (issue #14 item 4):

  1. reads the KJV text that Debian's bible-kjv-text package holds, one verse per line as
     `bible -f Gen1:1-Rev22:21` prints it ("Ge1:1 In the beginning God created ..."; a .gz file
     is read too), strips the verse references and joins each chapter's verses into one
     paragraph of prose: a chapter is a document, followed by EOS;
  2. holds out every --val_every_nth chapter (~2% of the text) as validation;
  3. trains a byte-level BPE tokenizer (Hugging Face `tokenizers`) in Llama-3's layout on the
     training chapters: Llama-3's split regex, ByteLevel without its own regex, a ByteLevel
     decoder and a TemplateProcessing post-processor that prepends <|begin_of_text|>;
  4. trains transformers' LlamaForCausalLM (AdamW, warmup + cosine, bf16 autocast on CUDA,
     residual dropout through hooks) on sequences of BOS + 255 contiguous tokens, evaluating on
     the held-out chapters every --eval_every steps and keeping the best weights (--save best);
  5. writes --out in Hugging Face layout (config.json, generation_config.json, model.safetensors
     in bf16, tokenizer.json, tokenizer_config.json) plus training_log.jsonl, loss.svg and
     train_summary.json. A README.md already in --out is left alone.

Seeded throughout; on a CPU two runs give the same model.safetensors bit for bit. --max_wall_s
(225 s) ends training early, saying so, should a slow machine put the 4-minute budget at risk.

  python3 models/tools/train_default_model.py --corpus .corpus/kjv.txt --out models/default
  python3 models/tools/train_default_model.py --corpus /tmp/kjv.txt --out /tmp/smoke \\
      --device cpu --steps 30 --batch_size 8          # a smoke test on a CPU

Needs torch, transformers (5.x), tokenizers, safetensors and numpy; no network.
"""
import argparse
import gzip
import hashlib
import json
import math
import os
import platform
import random
import re
import shlex
import sys
import time

# cuBLAS needs this before CUDA initialises to choose deterministic kernels.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

BOS = "<|begin_of_text|>"
EOS = "<|end_of_text|>"
# Llama-3's pre-tokenizer split, exactly as Meta's tokenizer.json spells it.
LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# One verse per line: book abbreviation (may start with a digit: 1Sm, 2Ki), chapter:verse, text.
VERSE_LINE = re.compile(r"^(\d?[A-Za-z]+)(\d+):(\d+)\s+(.*\S)\s*$")

T0 = time.time()


def log(msg):
    print(f"[{time.time() - T0:7.1f}s] {msg}", flush=True)


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--corpus", required=True,
                    help="KJV text, one verse per line as `bible -f Gen1:1-Rev22:21` prints it "
                         "(plain or .gz)")
    ap.add_argument("--out", required=True, help="output directory (Hugging Face layout)")
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    ap.add_argument("--steps", type=int, default=2000, help="optimizer steps")
    ap.add_argument("--batch_size", type=int, default=64, help="sequences per step")
    ap.add_argument("--seq_len", type=int, default=256, help="tokens per sequence, BOS included")
    ap.add_argument("--lr", type=float, default=2e-3, help="peak learning rate")
    ap.add_argument("--min_lr_ratio", type=float, default=0.1, help="final lr / peak lr")
    ap.add_argument("--warmup", type=int, default=100, help="linear warmup steps")
    ap.add_argument("--weight_decay", type=float, default=0.1)
    ap.add_argument("--dropout", type=float, default=0.1,
                    help="dropout on the embedding output and on each attention and MLP output "
                         "before its residual add, in training only (Llama has none; 1M tokens "
                         "seen for tens of epochs by a 7M model need some)")
    ap.add_argument("--grad_clip", type=float, default=1.0)
    ap.add_argument("--log_every", type=int, default=25)
    ap.add_argument("--eval_every", type=int, default=100)
    ap.add_argument("--val_every_nth", type=int, default=50,
                    help="chapters i with i %% N == N//2 are validation (50: ~2%%)")
    ap.add_argument("--vocab_size", type=int, default=4096, help="BPE vocab, specials included")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--intermediate", type=int, default=768)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv_heads", type=int, default=2)
    ap.add_argument("--save", choices=["best", "last"], default="best",
                    help="save the weights of the lowest validation loss (default) or the last "
                         "step")
    ap.add_argument("--max_wall_s", type=float, default=225.0,
                    help="stop training early (and say so) if the whole run reaches this many "
                         "seconds; 0 = no limit")
    ap.add_argument("--attn", choices=["eager", "sdpa"], default="eager",
                    help="transformers attention for training: eager (default) is "
                         "deterministic; sdpa may pick flash attention, whose backward is not "
                         "unless torch.use_deterministic_algorithms is strict")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch default)")
    return ap.parse_args()


# ---------------------------------------------------------------------------------------------
# Corpus


def read_corpus(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        raw = f.read()
    return raw, raw.decode("utf-8")


def chapters_from_verses(text):
    """[(book, chapter, prose)] in corpus order; refuses a file that is not one verse per line."""
    chapters, bad = [], []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        m = VERSE_LINE.match(line)
        if m is None:
            bad.append(n)
            continue
        book, chapter = m.group(1), int(m.group(2))
        body = " ".join(m.group(4).split())  # the dump has a few doubled spaces
        if not chapters or chapters[-1][0] != book or chapters[-1][1] != chapter:
            chapters.append((book, chapter, []))
        chapters[-1][2].append(body)
    if bad:
        sys.exit(f"train_default_model: {len(bad)} lines of the corpus are not 'Book1:1 text' "
                 f"(first: line {bad[0]}). Make the corpus with: "
                 "bible -f Gen1:1-Rev22:21 > kjv.txt")
    if len(chapters) < 100:
        sys.exit(f"train_default_model: only {len(chapters)} chapters in the corpus")
    return [(b, c, " ".join(v)) for b, c, v in chapters]


# ---------------------------------------------------------------------------------------------
# Tokenizer


def train_tokenizer(train_texts, vocab_size):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    tok = Tokenizer(models.BPE(ignore_merges=True))  # Llama-3 sets ignore_merges too
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=[BOS, EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(train_texts, trainer)
    bos = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos)])
    return tok


def check_tokenizer_json(path):
    """Fails loudly if tokenizer.json uses anything models/tokenizer/hf_tokenizer.cc rejects or
    would read differently (a newer `tokenizers` could change what it writes)."""
    with open(path, encoding="utf-8") as f:
        j = json.load(f)
    problems = []
    if j.get("normalizer") is not None:
        problems.append(f"normalizer {j['normalizer']}")
    pre = j.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else []
    if [s.get("type") for s in steps] != ["Split", "ByteLevel"]:
        problems.append(f"pre_tokenizer {pre}")
    else:
        split, bl = steps
        if (split.get("behavior") != "Isolated" or split.get("invert") or
                split.get("pattern") != {"Regex": LLAMA3_REGEX}):
            problems.append(f"Split {split}")
        if bl.get("add_prefix_space") or bl.get("use_regex", True):
            problems.append(f"ByteLevel {bl}")
    model = j.get("model", {})
    if model.get("type") != "BPE":
        problems.append(f"model type {model.get('type')}")
    for key in ("continuing_subword_prefix", "end_of_word_suffix", "dropout"):
        if model.get(key) is not None:
            problems.append(f"BPE {key}={model[key]}")
    if (j.get("decoder") or {}).get("type") != "ByteLevel":
        problems.append(f"decoder {j.get('decoder')}")
    post = j.get("post_processor") or {}
    if post.get("type") != "TemplateProcessing" or "SpecialToken" not in post["single"][0]:
        problems.append(f"post_processor {post}")
    specials = {t["content"]: t for t in j.get("added_tokens", [])}
    if set(specials) != {BOS, EOS} or not all(t["special"] for t in specials.values()):
        problems.append(f"added_tokens {list(specials)}")
    if problems:
        sys.exit("train_default_model: tokenizer.json has what tailserve's loader does not read: " +
                 "; ".join(problems))


# ---------------------------------------------------------------------------------------------
# Loss-curve plot, written by hand (no matplotlib on the GPU machine)


def nice_step(span, target_ticks):
    raw = span / max(1, target_ticks)
    mag = 10 ** math.floor(math.log10(raw)) if raw > 0 else 1
    for m in (1, 2, 2.5, 5, 10):
        if raw <= m * mag:
            return m * mag
    return 10 * mag


def write_loss_svg(path, train_pts, val_pts, title):
    """train_pts, val_pts: [(step, loss)]. Linear axes; y clipped to the range that matters."""
    W, H, L, R, T, B = 760, 440, 70, 20, 40, 55
    pw, ph = W - L - R, H - T - B
    all_pts = train_pts + val_pts
    x_max = max(p[0] for p in all_pts) or 1
    lo = min(p[1] for p in all_pts)
    # The first steps sit near ln(vocab); showing them squeezes the interesting part flat.
    tail = [p[1] for p in all_pts if p[0] >= 0.1 * x_max] or [p[1] for p in all_pts]
    hi = max(tail) + 0.5
    dy = nice_step(hi - lo, 8)
    y0, y1 = math.floor(lo / dy) * dy, math.ceil(hi / dy) * dy
    dx = nice_step(x_max, 8)

    def sx(x):
        return L + pw * x / x_max

    def sy(y):
        return T + ph * (1 - (min(max(y, y0), y1) - y0) / (y1 - y0))

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" '
           f'viewBox="0 0 {W} {H}" font-family="sans-serif" font-size="12">',
           f'<rect width="{W}" height="{H}" fill="white"/>',
           f'<text x="{W / 2}" y="22" text-anchor="middle" font-size="14">{title}</text>']
    y = y0
    while y <= y1 + 1e-9:
        out.append(f'<line x1="{L}" y1="{sy(y):.1f}" x2="{L + pw}" y2="{sy(y):.1f}" '
                   f'stroke="#e5e5e5"/>')
        out.append(f'<text x="{L - 6}" y="{sy(y) + 4:.1f}" text-anchor="end">{y:g}</text>')
        y += dy
    x = 0
    while x <= x_max + 1e-9:
        out.append(f'<line x1="{sx(x):.1f}" y1="{T}" x2="{sx(x):.1f}" y2="{T + ph}" '
                   f'stroke="#f0f0f0"/>')
        out.append(f'<text x="{sx(x):.1f}" y="{T + ph + 16}" text-anchor="middle">{x:g}</text>')
        x += dx
    out.append(f'<rect x="{L}" y="{T}" width="{pw}" height="{ph}" fill="none" stroke="black"/>')
    out.append(f'<text x="{L + pw / 2}" y="{H - 14}" text-anchor="middle">optimizer step</text>')
    out.append(f'<text x="16" y="{T + ph / 2}" text-anchor="middle" '
               f'transform="rotate(-90 16 {T + ph / 2})">cross-entropy (nats/token)</text>')
    for pts, color, name, dots in ((train_pts, "#1f77b4", "train (mean since last log)", False),
                                   (val_pts, "#d62728", "validation (held-out chapters)", True)):
        if not pts:
            continue
        poly = " ".join(f"{sx(s):.1f},{sy(v):.1f}" for s, v in pts)
        out.append(f'<polyline points="{poly}" fill="none" stroke="{color}" stroke-width="1.6"/>')
        if dots:
            out += [f'<circle cx="{sx(s):.1f}" cy="{sy(v):.1f}" r="2.5" fill="{color}"/>'
                    for s, v in pts]
    for i, (color, name) in enumerate((("#1f77b4", "train (mean since last log)"),
                                       ("#d62728", "validation (held-out chapters)"))):
        ly = T + 16 + 18 * i
        out.append(f'<line x1="{L + pw - 230}" y1="{ly - 4}" x2="{L + pw - 205}" y2="{ly - 4}" '
                   f'stroke="{color}" stroke-width="2"/>')
        out.append(f'<text x="{L + pw - 198}" y="{ly}">{name}</text>')
    out.append("</svg>")
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(out) + "\n")


# ---------------------------------------------------------------------------------------------
# Training


def seed_everything(seed, torch):
    random.seed(seed)
    import numpy as np
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)
    # Best effort: warn_only keeps the run going where an op has no deterministic kernel.
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False


def build_model(args, vocab, bos_id, eos_id):
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, head_dim=args.hidden // args.heads,
        max_position_embeddings=2048, rms_norm_eps=1e-5, hidden_act="silu",
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=True, attention_bias=False, mlp_bias=False, attention_dropout=0.0,
        initializer_range=0.02, bos_token_id=bos_id, eos_token_id=eos_id, pad_token_id=None)
    model = LlamaForCausalLM._from_config(config, attn_implementation=args.attn)
    model.generation_config = GenerationConfig(bos_token_id=bos_id, eos_token_id=eos_id)
    return model


def add_dropout_hooks(model, p):
    """nanoGPT-style residual dropout through forward hooks: the module tree, the saved files
    and inference are untouched (dropout acts only in training mode)."""
    import torch.nn.functional as F

    def on_tensor(module, inputs, output):
        return F.dropout(output, p, module.training)

    def on_attention(module, inputs, output):  # LlamaAttention returns (output, weights)
        return (F.dropout(output[0], p, module.training),) + tuple(output[1:])

    model.model.embed_tokens.register_forward_hook(on_tensor)
    for layer in model.model.layers:
        layer.self_attn.register_forward_hook(on_attention)
        layer.mlp.register_forward_hook(on_tensor)


def lr_at(step, args):
    """Linear warmup to --lr over --warmup steps, then cosine down to lr * min_lr_ratio."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    t = (step - args.warmup) / max(1, args.steps - args.warmup)
    cosine = 0.5 * (1 + math.cos(math.pi * t))
    return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * cosine)


class Batches:
    """Windows of seq_len-1 contiguous tokens (BOS prepended) and their seq_len next-token
    targets, drawn without replacement within an epoch; each epoch cuts the stream at a fresh
    random phase so the windows do not repeat exactly."""

    def __init__(self, stream, seq_len, batch, bos_id, gen, torch):
        self.torch, self.stream, self.gen = torch, stream, gen
        self.T, self.B, self.bos = seq_len, batch, bos_id
        self.epoch, self.order, self.at, self.phase = -1, None, 0, 0
        self.offsets = torch.arange(seq_len, device=stream.device)

    def _new_epoch(self):
        torch = self.torch
        self.epoch += 1
        self.phase = int(torch.randint(0, self.T, (1,), generator=self.gen))
        n = (self.stream.numel() - self.phase) // self.T
        self.order = torch.randperm(n, generator=self.gen).to(self.stream.device)
        self.at = 0

    def next(self):
        torch = self.torch
        if self.order is None or self.at + self.B > self.order.numel():
            self._new_epoch()  # the remainder of the last epoch is dropped
        starts = self.phase + self.order[self.at:self.at + self.B] * self.T
        self.at += self.B
        targets = self.stream[starts[:, None] + self.offsets]           # [B, T]
        bos = torch.full((self.B, 1), self.bos, dtype=targets.dtype, device=targets.device)
        inputs = torch.cat([bos, targets[:, :-1]], dim=1)               # [B, T]
        return inputs, targets

    def epochs_done(self):
        return self.epoch + (self.at / self.order.numel() if self.order is not None else 0)


def fixed_windows(stream, seq_len, bos_id, torch, limit=None):
    """Non-overlapping evaluation windows over a stream, same BOS + contiguous layout; with
    `limit`, that many windows spread evenly over the whole stream."""
    n = stream.numel() // seq_len
    targets = stream[:n * seq_len].view(n, seq_len)
    if limit is not None and limit < n:
        targets = targets[torch.linspace(0, n - 1, limit, device=stream.device).long()]
        n = limit
    bos = torch.full((n, 1), bos_id, dtype=targets.dtype, device=targets.device)
    return torch.cat([bos, targets[:, :-1]], dim=1), targets


def mean_loss(model, windows, batch, autocast, torch):
    import torch.nn.functional as F
    inputs, targets = windows
    total, count = 0.0, 0
    model.eval()
    with torch.no_grad():
        for i in range(0, inputs.shape[0], batch):
            with autocast():
                logits = model(input_ids=inputs[i:i + batch]).logits
            loss = F.cross_entropy(logits.float().flatten(0, 1), targets[i:i + batch].flatten(),
                                   reduction="sum")
            total += float(loss)
            count += targets[i:i + batch].numel()
    model.train()
    return total / count


def main():
    args = parse_args()
    import contextlib

    import numpy as np
    import tokenizers
    import torch
    import torch.nn.functional as F
    import transformers

    if args.heads * (args.hidden // args.heads) != args.hidden or args.hidden // args.heads not in (
            16, 64, 128):
        sys.exit("train_default_model: hidden / heads must be a head_dim tailserve's kernels "
                 "support (16, 64, 128)")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("train_default_model: --device cuda but no CUDA device; use --device cpu")
    seed_everything(args.seed, torch)
    os.makedirs(args.out, exist_ok=True)

    # Corpus -> chapters -> train / validation.
    raw, text = read_corpus(args.corpus)
    chapters = chapters_from_verses(text)
    is_val = [i % args.val_every_nth == args.val_every_nth // 2 for i in range(len(chapters))]
    train_docs = [c[2] for c, v in zip(chapters, is_val) if not v]
    val_docs = [c[2] for c, v in zip(chapters, is_val) if v]
    val_names = [f"{b}{c}" for (b, c, _), v in zip(chapters, is_val) if v]
    log(f"corpus {args.corpus}: {len(raw)} bytes, {len(chapters)} chapters "
        f"({len(train_docs)} train, {len(val_docs)} validation: {' '.join(val_names)})")

    # Tokenizer.
    t_tok = time.time()
    tok = train_tokenizer(train_docs, args.vocab_size)
    tok_path = os.path.join(args.out, "tokenizer.json")
    tok.save(tok_path)
    check_tokenizer_json(tok_path)
    bos_id, eos_id = tok.token_to_id(BOS), tok.token_to_id(EOS)
    vocab = tok.get_vocab_size(with_added_tokens=True)
    if vocab != args.vocab_size:
        sys.exit(f"train_default_model: the tokenizer has {vocab} ids, not {args.vocab_size}")
    with open(os.path.join(args.out, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump({"bos_token": BOS, "eos_token": EOS, "model_max_length": 2048,
                   "tokenizer_class": "PreTrainedTokenizerFast",
                   # Decode exactly as `tokenizers` (and tailserve) does: no " ," -> "," cleanup.
                   "clean_up_tokenization_spaces": False}, f, indent=2)
        f.write("\n")

    def encode_docs(docs):
        ids = []
        for enc in tok.encode_batch(docs, add_special_tokens=False):
            ids += enc.ids + [eos_id]
        return np.asarray(ids, dtype=np.int64)

    train_ids, val_ids = encode_docs(train_docs), encode_docs(val_docs)
    tok_s = time.time() - t_tok
    for doc in val_docs[:3]:  # byte-level BPE must round-trip exactly
        if tok.decode(tok.encode(doc, add_special_tokens=False).ids) != doc:
            sys.exit("train_default_model: the tokenizer does not round-trip a chapter")
    log(f"tokenizer: vocab {vocab} (BOS {bos_id}, EOS {eos_id}), trained and applied in "
        f"{tok_s:.1f}s; {train_ids.size} train tokens, {val_ids.size} validation tokens "
        f"({100 * val_ids.size / (train_ids.size + val_ids.size):.2f}%), "
        f"{len(text) / (train_ids.size + val_ids.size):.2f} chars/token")

    # Model and optimizer.
    model = build_model(args, vocab, bos_id, eos_id).to(device)
    if args.dropout > 0:
        add_dropout_hooks(model, args.dropout)
    n_params = sum(p.numel() for p in model.parameters())  # tied: the embedding counts once
    n_embed = model.model.embed_tokens.weight.numel()
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8,
                            fused=device.type == "cuda")
    if device.type == "cuda":
        def autocast():
            return torch.autocast("cuda", dtype=torch.bfloat16)
    else:
        autocast = contextlib.nullcontext  # fp32 on CPU: a smoke test, not a model
    gen = torch.Generator().manual_seed(args.seed)
    train_stream = torch.from_numpy(train_ids).to(device)
    val_stream = torch.from_numpy(val_ids).to(device)
    batches = Batches(train_stream, args.seq_len, args.batch_size, bos_id, gen, torch)
    val_windows = fixed_windows(val_stream, args.seq_len, bos_id, torch)
    # The same number of windows from the training stream: an eval-mode train loss on a fixed set
    # that is comparable with the validation loss (the running loss mixes in old weights).
    train_windows = fixed_windows(train_stream, args.seq_len, bos_id, torch,
                                  limit=val_windows[0].shape[0])
    tokens_per_step = args.batch_size * args.seq_len
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    log(f"model: {n_params} parameters ({n_params - n_embed} outside the tied embedding), "
        f"{args.layers} layers, hidden {args.hidden}, {args.heads} heads / {args.kv_heads} KV "
        f"heads, attention {args.attn}, dropout {args.dropout}; device {device_name}; "
        f"{args.steps} steps x {tokens_per_step} tokens = "
        f"{args.steps * tokens_per_step / train_ids.size:.1f} epochs")

    log_path = os.path.join(args.out, "training_log.jsonl")
    log_file = open(log_path, "w", encoding="utf-8")
    train_pts, val_pts = [], []
    best = {"val_loss": float("inf"), "step": None, "state": None}
    run_sum, run_n = 0.0, 0
    stopped_early = None
    t_train = time.time()
    step = 0
    model.train()
    for step in range(1, args.steps + 1):
        lr = lr_at(step - 1, args)
        for g in opt.param_groups:
            g["lr"] = lr
        inputs, targets = batches.next()
        with autocast():
            logits = model(input_ids=inputs).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        run_sum += loss.detach()
        run_n += 1

        last = step == args.steps
        over_time = args.max_wall_s > 0 and time.time() - T0 > args.max_wall_s
        if over_time:
            stopped_early = step
            last = True
        if step % args.log_every == 0 or step % args.eval_every == 0 or last:
            train_loss = float(run_sum) / run_n  # one sync per log line, not per step
            run_sum, run_n = 0.0, 0
            record = {"step": step, "train_loss": round(train_loss, 5), "val_loss": None,
                      "lr": lr, "elapsed_s": round(time.time() - T0, 2),
                      "tokens_seen": step * tokens_per_step,
                      "epoch": round(batches.epochs_done(), 3)}
            train_pts.append((step, train_loss))
            msg = ""
            if step % args.eval_every == 0 or last:
                val_loss = mean_loss(model, val_windows, args.batch_size, autocast, torch)
                record["val_loss"] = round(val_loss, 5)
                val_pts.append((step, val_loss))
                msg = f" val {val_loss:.4f}"
                if val_loss < best["val_loss"]:
                    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
                    best.update(val_loss=val_loss, step=step, state=state)
                    msg += " (best)"
            log_file.write(json.dumps(record) + "\n")
            log_file.flush()
            rate = step * tokens_per_step / (time.time() - t_train)
            log(f"step {step:5d}/{args.steps} epoch {record['epoch']:6.2f} lr {lr:.2e} "
                f"train {train_loss:.4f}{msg}  {rate / 1e3:.0f}k tok/s")
            if step == args.log_every:
                projected = (time.time() - t_train) / step * args.steps + (t_train - T0)
                log(f"projected total wall time ~{projected:.0f}s")
        if over_time:
            log(f"STOPPING EARLY at step {step}: the run reached --max_wall_s {args.max_wall_s}")
            break
    log_file.close()
    train_s = time.time() - t_train
    final_val = val_pts[-1][1]
    final_train_eval = mean_loss(model, train_windows, args.batch_size, autocast, torch)
    last_step = step

    if args.save == "best" and best["state"] is not None:
        model.load_state_dict(best["state"])
    saved_step = best["step"] if args.save == "best" else last_step
    saved_val = mean_loss(model, val_windows, args.batch_size, autocast, torch)
    saved_train_eval = mean_loss(model, train_windows, args.batch_size, autocast, torch)

    # bf16 on disk. transformers writes no lm_head.weight for tied embeddings; RoPE's inv_freq is
    # a non-persistent buffer, so the cast below does not reach the file.
    model.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    model.save_pretrained(args.out)
    log(f"saved step {saved_step} (--save {args.save}) to {args.out}")

    # Reload from the files, as a user would, and check what a loader will see.
    from safetensors import safe_open
    from transformers import AutoTokenizer, LlamaForCausalLM
    st_path = os.path.join(args.out, "model.safetensors")
    with safe_open(st_path, "pt") as f:
        names = list(f.keys())
        dtypes = {str(f.get_tensor(n).dtype) for n in names}
    if "lm_head.weight" in names or dtypes != {"torch.bfloat16"}:
        sys.exit(f"train_default_model: unexpected model.safetensors (lm_head present: "
                 f"{'lm_head.weight' in names}, dtypes {dtypes})")
    reloaded = LlamaForCausalLM.from_pretrained(args.out, dtype=torch.float32).to(device).eval()
    hf_tok = AutoTokenizer.from_pretrained(args.out)
    samples = []
    for prompt in ("In the beginning God created", "And the LORD said unto Moses,",
                   "Blessed are the", "The LORD is my shepherd;"):
        ids = hf_tok(prompt, return_tensors="pt").input_ids.to(device)
        if ids[0, 0].item() != bos_id:
            sys.exit("train_default_model: the saved tokenizer does not prepend BOS")
        with torch.no_grad():
            out = reloaded.generate(ids, max_new_tokens=40, do_sample=False,
                                    pad_token_id=eos_id)
        cont = hf_tok.decode(out[0, ids.shape[1]:], skip_special_tokens=False)
        samples.append({"prompt": prompt, "greedy_fp32": cont})
        log(f"sample: {prompt!r} -> {cont!r}")

    write_loss_svg(os.path.join(args.out, "loss.svg"), train_pts, val_pts,
                   f"tailserve default model: {n_params / 1e6:.2f}M-parameter Llama on the KJV "
                   f"(saved step {saved_step}, val {saved_val:.3f})")
    wall_s = time.time() - T0
    files = sorted(n for n in os.listdir(args.out) if n != "train_summary.json")
    summary = {
        "saved": {"which": args.save, "step": saved_step, "val_loss": round(saved_val, 5),
                  "train_loss_eval": round(saved_train_eval, 5)},
        "final_step": {"step": last_step, "val_loss": round(final_val, 5),
                       "train_loss_eval": round(final_train_eval, 5),
                       "train_loss_running": round(train_pts[-1][1], 5)},
        "best_val": {"step": best["step"], "val_loss": round(best["val_loss"], 5)},
        "stopped_early_at_step": stopped_early,
        "params": n_params, "params_non_embedding": n_params - n_embed,
        "tokens_seen": last_step * tokens_per_step,
        "epochs": round(batches.epochs_done(), 3),
        "train_tokens": int(train_ids.size), "val_tokens": int(val_ids.size),
        "val_chapters": val_names,
        "wall_s": round(wall_s, 1), "train_loop_s": round(train_s, 1),
        "tokenizer_s": round(tok_s, 1),
        "command": " ".join(shlex.quote(a) for a in [sys.executable] + sys.argv),
        "args": vars(args),
        "corpus": {"path": args.corpus, "bytes": len(raw),
                   "sha256": hashlib.sha256(raw).hexdigest(), "chapters": len(chapters)},
        "tokenizer": {"vocab": vocab, "bos_id": bos_id, "eos_id": eos_id},
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": transformers.__version__,
                     "tokenizers": tokenizers.__version__,
                     "cuda": torch.version.cuda if device.type == "cuda" else None},
        "device": (torch.cuda.get_device_name(device) if device.type == "cuda"
                   else f"cpu ({platform.processor() or platform.machine()}, "
                        f"{torch.get_num_threads()} threads)"),
        "samples": samples,
        "model_safetensors_sha256": hashlib.sha256(open(st_path, "rb").read()).hexdigest(),
        "files": {n: os.path.getsize(os.path.join(args.out, n)) for n in files},
    }
    with open(os.path.join(args.out, "train_summary.json"), "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=2)
        f.write("\n")
    log(f"done: saved step {saved_step}, val {saved_val:.4f}, train(eval) {saved_train_eval:.4f}; "
        f"{wall_s:.0f}s wall; wrote {', '.join(files + ['train_summary.json'])}")


if __name__ == "__main__":
    main()
