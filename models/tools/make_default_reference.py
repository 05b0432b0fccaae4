#!/usr/bin/env python3
"""Writes the transformers references that tailserve's tests hold the default model to.

For 4 fixed English prompts (tokenized by the model's tokenizer.json with its special tokens, so
BOS comes first) it records:
  - the prompt ids;
  - the greedy continuation of --new_tokens ids from transformers in fp32 (on --fp32_device,
    default cpu) and, when CUDA is there, in bf16 on CUDA, with the decoded text. Greedy here is
    the argmax of one full forward pass per step (no KV cache, no sampling), and EOS is an ordinary
    token, not a stop: what tailserve produces with --ignore_eos;
  - a teacher-forced check: the fp32 greedy sequence (prompt + new tokens) run through one forward
    pass in fp32 and in bf16; for each of the generated positions, the top-1 id and the
    top1 - top2 logit margin of each dtype (the top-1 is argmax's: the lowest id among tied
    maxima). A test can then skip, or loosen, the positions whose margin is too small for its
    dtype;
  - the sha256 of model.safetensors and tokenizer.json, so a test can tell that the reference
    belongs to the model beside it.

The bf16 model is loaded from the files with dtype=torch.bfloat16 rather than built in fp32 and
cast with model.to(torch.bfloat16): the cast also turns RoPE's inv_freq buffer into bf16 (seen
with transformers 5.24), which tailserve does not do; see also tests/gpu/make_llama_reference.py.
The checkpoint is bf16 on disk, so both ways hold the same weights.

  python3 models/tools/make_default_reference.py --model models/default --out ref.json
  python3 models/tools/make_default_reference.py --model /tmp/smoke --out /tmp/ref.json --device cpu
"""
import argparse
import hashlib
import json
import os
import platform
import re
import sys

PROMPTS = ["In the beginning God created", "And the LORD said unto Moses,", "Blessed are the",
           "The LORD is my shepherd;"]


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="the model directory (Hugging Face layout)")
    ap.add_argument("--out", required=True, help="the JSON file to write")
    ap.add_argument("--device", default="cuda",
                    help="cuda (default: fp32 and bf16 references) or cpu (fp32 only)")
    ap.add_argument("--fp32_device", default="cpu",
                    help="where the fp32 reference runs (default cpu: no TF32, no GPU kernels)")
    ap.add_argument("--new_tokens", type=int, default=64)
    ap.add_argument("--attn", default="eager", choices=["eager", "sdpa"],
                    help="transformers attention implementation for both dtypes")
    args = ap.parse_args()

    import tokenizers
    import torch
    import transformers
    from transformers import AutoTokenizer, LlamaForCausalLM

    torch.manual_seed(0)
    use_cuda = args.device == "cuda"
    if use_cuda and not torch.cuda.is_available():
        sys.exit("make_default_reference: --device cuda but no CUDA device; use --device cpu")
    if args.fp32_device == "cuda" and not torch.cuda.is_available():
        sys.exit("make_default_reference: --fp32_device cuda but no CUDA device")
    if torch.cuda.is_available():
        # fp32 on the GPU means IEEE fp32: no TF32 matmuls.
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False

    tok = tokenizers.Tokenizer.from_file(os.path.join(args.model, "tokenizer.json"))
    hf_tok = AutoTokenizer.from_pretrained(args.model)
    with open(os.path.join(args.model, "config.json"), encoding="utf-8") as f:
        config = json.load(f)

    def load(dtype, device):
        m = LlamaForCausalLM.from_pretrained(args.model, dtype=dtype, attn_implementation=args.attn)
        return m.to(device).eval()

    fp32 = load(torch.float32, args.fp32_device)
    bf16 = load(torch.bfloat16, "cuda") if use_cuda else None

    @torch.inference_mode()
    def logits_of(model, ids):
        dev = next(model.parameters()).device
        return model(input_ids=torch.tensor([ids], device=dev)).logits[0].float().cpu()

    def greedy(model, prompt):
        ids = list(prompt)
        for _ in range(args.new_tokens):
            ids.append(int(torch.argmax(logits_of(model, ids)[-1])))
        return ids[len(prompt):]

    def teacher_forced(model, seq, n_prompt):
        logits = logits_of(model, seq)[n_prompt - 1:len(seq) - 1]  # the positions that predict
        top = torch.topk(logits, 2, dim=-1)                          # the generated tokens
        # The top-1 is argmax's, the first of tied maxima, as greedy() and transformers' own
        # generate pick it; topk orders ties arbitrarily, and bf16 logits tie often (their step
        # is 1/16 at 8-16). The margin of a tie is 0.
        return {"top1": torch.argmax(logits, dim=-1).tolist(),
                "margin": [round(float(m), 6) for m in top.values[:, 0] - top.values[:, 1]]}

    def first_difference(a, b):
        return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)

    cases = []
    for prompt in PROMPTS:
        ids = tok.encode(prompt, add_special_tokens=True).ids
        if ids[0] != config["bos_token_id"]:
            sys.exit(f"make_default_reference: {prompt!r} does not start with BOS")
        if hf_tok(prompt).input_ids != ids:
            sys.exit(f"make_default_reference: transformers' tokenizer disagrees on {prompt!r}")
        g32 = greedy(fp32, ids)
        seq = ids + g32
        case = {"prompt": prompt, "prompt_ids": ids,
                "fp32": {"greedy_ids": g32,
                         "greedy_text": tok.decode(g32, skip_special_tokens=False),
                         "teacher_forced": teacher_forced(fp32, seq, len(ids))}}
        tf = case["fp32"]["teacher_forced"]
        case["fp32"]["teacher_forced_top1_equals_greedy"] = tf["top1"] == g32
        case["fp32"]["min_margin"] = min(tf["margin"])
        if bf16 is not None:
            g16 = greedy(bf16, ids)
            tf16 = teacher_forced(bf16, seq, len(ids))
            case["bf16"] = {"greedy_ids": g16,
                            "greedy_text": tok.decode(g16, skip_special_tokens=False),
                            "first_difference_from_fp32": first_difference(g16, g32),
                            "teacher_forced": tf16,
                            "teacher_forced_top1_agrees_with_fp32": sum(
                                a == b for a, b in zip(tf16["top1"], g32)),
                            "min_margin": min(tf16["margin"])}
        cases.append(case)
        line = f"{prompt!r} -> {case['fp32']['greedy_text']!r} (fp32 min margin " \
               f"{case['fp32']['min_margin']:.3f}"
        if bf16 is not None:
            b16 = case["bf16"]
            line += (f"; bf16 greedy first differs at {b16['first_difference_from_fp32']}, "
                     f"teacher-forced top-1 agrees on {b16['teacher_forced_top1_agrees_with_fp32']}"
                     f"/{args.new_tokens}, bf16 min margin {b16['min_margin']:.3f}")
        print(line + ")", flush=True)

    ref = {
        "model_dir": args.model,
        "model_safetensors_sha256": sha256(os.path.join(args.model, "model.safetensors")),
        "tokenizer_json_sha256": sha256(os.path.join(args.model, "tokenizer.json")),
        "new_tokens": args.new_tokens,
        "greedy": "argmax of a full forward pass per step, no KV cache; EOS is not a stop",
        "teacher_forced": "one forward pass over prompt + fp32 greedy ids; entry k is the position "
                          "predicting generated token k; margin = top1 - top2 logit",
        "attn_implementation": args.attn,
        "fp32": {"device": args.fp32_device if args.fp32_device == "cpu"
                 else torch.cuda.get_device_name(), "load": "from_pretrained(dtype=torch.float32)",
                 "tf32": False},
        "bf16": ({"device": torch.cuda.get_device_name(),
                  "load": "from_pretrained(dtype=torch.bfloat16)",
                  "rope_inv_freq_dtype": str(bf16.model.rotary_emb.inv_freq.dtype).replace(
                      "torch.", "")}
                 if bf16 is not None else None),
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": transformers.__version__,
                     "tokenizers": tokenizers.__version__},
        "cases": cases,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    text = json.dumps(ref, indent=1, ensure_ascii=False)
    # One line per list of numbers: 64-entry lists one number a line would bury the structure.
    text = re.sub(r"\[\s*(-?[\d.e+-]+(?:,\s*-?[\d.e+-]+)*)\s*\]",
                  lambda m: "[" + ", ".join(x.strip() for x in m.group(1).split(",")) + "]", text)
    with open(args.out, "w", encoding="utf-8") as f:
        f.write(text + "\n")
    print(f"make_default_reference: wrote {args.out}")


if __name__ == "__main__":
    main()
