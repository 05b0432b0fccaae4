#!/usr/bin/env python3
"""Writes the reference for engine_cuda_hf_logits_test, on the GPU machine (torch + transformers).

A random-weight LlamaForCausalLM in the real Llama-3.2-1B shape (hidden 2048, 16 layers, 32/8
heads, head_dim 64, intermediate 8192, vocab 128256, tied embeddings, llama3 rope scaling as the
published config), saved with save_pretrained in bf16, plus transformers' teacher-forced bf16
logits on the GPU for 4 random prompts of 64 tokens:

  <out>/config.json, generation_config.json, model.safetensors   the checkpoint
  <out>/prompts.json                                            {"prompts": [[64 ids] x 4], ...}
  <out>/reference_logits.safetensors                            F32 logits_<i> [64, vocab]

The logits come from the saved files loaded back (what the C++ test loads too), in bf16 with
sdpa attention, as a user of transformers would run the model.

  python3 tests/gpu/make_llama1b_reference.py --out /tmp/llama1b
  TS_LLAMA1B_DIR=/tmp/llama1b ctest --test-dir build-gpu -R engine_cuda_hf_logits_test -V
"""
import argparse
import json
import os
import time

import torch
import transformers
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM


def make_config():
    rope = {
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    common = dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        vocab_size=128256,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
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


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("TS_LLAMA1B_DIR", "/tmp/llama1b"))
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--positions", type=int, default=64)
    ap.add_argument("--seed", type=int, default=20241129)
    args = ap.parse_args()
    assert torch.cuda.is_available(), "needs the GPU machine"
    os.makedirs(args.out, exist_ok=True)
    t0 = time.time()

    torch.manual_seed(args.seed)
    config = make_config()
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
    print(f"saved checkpoint to {args.out} ({time.time() - t0:.1f} s)", flush=True)

    model = LlamaForCausalLM.from_pretrained(args.out, dtype=torch.bfloat16).cuda().eval()
    gen = torch.Generator().manual_seed(args.seed + 1)
    prompts = torch.randint(0, config.vocab_size, (args.prompts, args.positions), generator=gen)
    prompts[:, 0] = config.bos_token_id
    tensors = {}
    with torch.no_grad():
        for i in range(args.prompts):
            ids = prompts[i : i + 1].cuda()
            logits = model(input_ids=ids).logits[0]  # [positions, vocab] bf16
            tensors[f"logits_{i}"] = logits.float().cpu().contiguous()
            top2 = torch.topk(logits.float(), 2, dim=-1).values
            margin = (top2[:, 0] - top2[:, 1]).min().item()
            print(f"prompt {i}: logits std {logits.float().std().item():.3f}, "
                  f"min top1-top2 margin {margin:.4f}", flush=True)
    save_file(tensors, os.path.join(args.out, "reference_logits.safetensors"))
    with open(os.path.join(args.out, "prompts.json"), "w") as f:
        json.dump({
            "prompts": prompts.tolist(),
            "dtype": "bfloat16",
            "attn_implementation": model.config._attn_implementation,
            "transformers_version": transformers.__version__,
            "torch_version": torch.__version__,
            "seed": args.seed,
        }, f)
    print(f"wrote {args.out} in {time.time() - t0:.1f} s", flush=True)


if __name__ == "__main__":
    main()
