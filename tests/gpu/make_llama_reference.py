#!/usr/bin/env python3
"""Writes the reference for engine_cuda_hf_logits_test, on the GPU machine (torch + transformers).

A random-weight LlamaForCausalLM in a real Llama-3 shape, saved with save_pretrained in bf16:

  --shape 1b   Llama-3.2-1B: hidden 2048, 16 layers, 32/8 heads, head_dim 64, intermediate 8192,
               tied embeddings, llama3 rope scaling factor 32; 16 prompts x 64 positions
  --shape 8b   Llama-3.1-8B: hidden 4096, 32 layers, 32/8 heads, head_dim 128, intermediate
               14336, untied, llama3 rope scaling factor 8; 8 prompts x 128 positions

1024 rows each: top-1 agreement near 90% then has a standard error under 1 point, below the
test's 1-point margin (with 4 x 64 rows it was 1.7 points, as wide as the band itself).

plus transformers' teacher-forced bf16 logits on the GPU (sdpa attention, as a user of
transformers runs the model) and, measured in the same run on the same prompts, the agreement of
transformers' own variants with those logits. Random weights make the logits flat, so a change of
fp32 summation order alone flips argmaxes; the variants measure how far transformers moves from
itself, and the C++ test holds us to that band (docs/numerics.md):

  sum_order    every Linear as an fp32 matmul (TF32 off) rounded to bf16 once: cuBLAS's bf16 GEMM
               math with fp32 accumulation, in another summation order
  sdpa_flash   scaled_dot_product_attention forced to the flash backend
  sdpa_math    scaled_dot_product_attention forced to the math backend

Each variant is counted as the test counts us: first-index argmax agreement over every row, and
the worst per-prompt ||variant - ref|| / ||ref||. Files:

  <out>/config.json, generation_config.json, model*.safetensors   the checkpoint
  <out>/prompts.json             {"prompts": [[ids] x N], "variants": {name: {top1, ...}}, ...}
  <out>/reference_logits.safetensors                              F32 logits_<i> [positions, vocab]

  python3 tests/gpu/make_llama_reference.py --shape 1b --out /tmp/llama1b
  TS_LLAMA1B_DIR=/tmp/llama1b build-gpu/tests/engine/engine_cuda_hf_logits_test
"""
import argparse
import contextlib
import json
import os
import time

import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM

SHAPES = {
    "1b": dict(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, tie_word_embeddings=True, rope_factor=32.0,
        positions=64, prompts=16),
    "8b": dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, tie_word_embeddings=False, rope_factor=8.0,
        positions=128, prompts=8),
}


def make_config(shape):
    s = dict(SHAPES[shape])
    s.pop("positions")
    s.pop("prompts")
    rope = {
        "rope_type": "llama3",
        "factor": s.pop("rope_factor"),
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    common = dict(
        s,
        vocab_size=128256,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        bos_token_id=128000,
        eos_token_id=[128001, 128008, 128009],
        attention_bias=False,
        mlp_bias=False,
        hidden_act="silu",
    )
    major = int(transformers.__version__.split(".")[0])
    if major >= 5:
        # transformers 5 keeps rope_theta inside rope_parameters.
        return LlamaConfig(rope_parameters=dict(rope, rope_theta=500000.0), **common)
    return LlamaConfig(rope_theta=500000.0, rope_scaling=rope, **common)


def metrics(logits, ref):
    """What the C++ test computes for us: first-index top-1 over all rows, worst per-prompt rel."""
    rows = agree = 0
    worst = 0.0
    for got, want in zip(logits, ref):
        got, want = got.double(), want.double()
        agree += (got.argmax(-1) == want.argmax(-1)).sum().item()
        rows += got.shape[0]
        worst = max(worst, ((got - want).norm() / want.norm()).item())
    return {"top1": agree / rows, "worst_rel_err": worst}


def fp32_linear(self, x):
    return F.linear(x.float(), self.weight.float()).to(x.dtype)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    ap.add_argument("--out", required=True)
    ap.add_argument("--prompts", type=int, default=0, help="0: the shape's default")
    ap.add_argument("--positions", type=int, default=0, help="0: the shape's default")
    ap.add_argument("--seed", type=int, default=20241129)
    args = ap.parse_args()
    assert torch.cuda.is_available(), "needs the GPU machine"
    positions = args.positions or SHAPES[args.shape]["positions"]
    args.prompts = args.prompts or SHAPES[args.shape]["prompts"]
    os.makedirs(args.out, exist_ok=True)
    t0 = time.time()
    torch.backends.cuda.matmul.allow_tf32 = False

    torch.manual_seed(args.seed)
    config = make_config(args.shape)
    # Random init on the GPU in fp32 (HF's initializer_range 0.02, norms 1), then bf16.
    with torch.device("cuda"):
        model = LlamaForCausalLM(config)
    # Norm weights away from 1, so a loader that skips them fails (as in tests/fixtures).
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    model = model.to(torch.bfloat16)
    model.save_pretrained(args.out, safe_serialization=True)
    del model
    torch.cuda.empty_cache()
    print(f"saved the {args.shape} checkpoint to {args.out} ({time.time() - t0:.1f} s)", flush=True)
    # Loaded back, as a user of transformers (and the C++ test) loads the files. Not the in-memory
    # model: model.to(bfloat16) also casts the rotary embedding's inv_freq buffer to bf16, which
    # from_pretrained keeps in fp32; measured 2026-12-01, that alone moved the 8B shape's logits
    # by 15% (relative) against ours, and the 1B shape's top-1 by 5 points.
    model = LlamaForCausalLM.from_pretrained(args.out, dtype=torch.bfloat16,
                                             attn_implementation="sdpa").cuda().eval()

    gen = torch.Generator().manual_seed(args.seed + 1)
    prompts = torch.randint(0, config.vocab_size, (args.prompts, positions), generator=gen)
    prompts[:, 0] = config.bos_token_id

    def run(ctx=contextlib.nullcontext):
        out = []
        with torch.no_grad(), ctx():
            for i in range(args.prompts):
                out.append(model(input_ids=prompts[i : i + 1].cuda()).logits[0].float().cpu())
        return out

    ref = run()
    tensors = {}
    for i, logits in enumerate(ref):
        tensors[f"logits_{i}"] = logits.contiguous()
        top2 = torch.topk(logits, 2, dim=-1).values
        print(f"prompt {i}: logits std {logits.std().item():.3f}, "
              f"min top1-top2 margin {(top2[:, 0] - top2[:, 1]).min().item():.4f}", flush=True)
    save_file(tensors, os.path.join(args.out, "reference_logits.safetensors"))

    variants = {}
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    for m in linears:
        m.forward = fp32_linear.__get__(m)
    variants["sum_order"] = metrics(run(), ref)
    for m in linears:
        del m.forward
    from torch.nn.attention import SDPBackend, sdpa_kernel
    for name, backend in (("sdpa_flash", SDPBackend.FLASH_ATTENTION),
                          ("sdpa_math", SDPBackend.MATH)):
        variants[name] = metrics(run(lambda: sdpa_kernel(backend)), ref)
    variants_check = metrics(run(), ref)  # a rerun must reproduce the reference exactly
    for name, v in variants.items():
        print(f"variant {name:10s}: top-1 {100 * v['top1']:.2f}%, "
              f"worst rel err {v['worst_rel_err']:.3e}", flush=True)
    print(f"rerun: top-1 {100 * variants_check['top1']:.2f}%, "
          f"rel err {variants_check['worst_rel_err']:.3e}", flush=True)

    with open(os.path.join(args.out, "prompts.json"), "w") as f:
        json.dump({
            "prompts": prompts.tolist(),
            "shape": args.shape,
            "variants": variants,
            "rerun": variants_check,
            "dtype": "bfloat16",
            "attn_implementation": model.config._attn_implementation,
            "transformers_version": transformers.__version__,
            "torch_version": torch.__version__,
            "seed": args.seed,
        }, f)
    print(f"wrote {args.out} in {time.time() - t0:.1f} s", flush=True)


if __name__ == "__main__":
    main()
