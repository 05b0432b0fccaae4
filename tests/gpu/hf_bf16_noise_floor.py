#!/usr/bin/env python3
"""How closely does transformers agree with itself across precisions on the Llama-1B-shape
reference? Loads <dir> (written by make_llama1b_reference.py) in bf16 and in fp32 and prints, over
the same prompts, the top-1 agreement and relative error of bf16 vs fp32 logits, and of the stored
reference vs fp32. This is the noise floor engine_cuda_hf_logits_test's numbers should be read
against.

  python3 tests/gpu/hf_bf16_noise_floor.py /tmp/llama1b
"""
import json
import sys

import torch
from safetensors.torch import load_file
from transformers import LlamaForCausalLM


def compare(name, a, b):
    agree = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
    rel = ((a - b).norm() / b.norm()).item()
    print(f"{name}: top-1 agreement {100 * agree:.2f}%, rel err {rel:.3e}, "
          f"max |err| {(a - b).abs().max().item():.4f}")


def main():
    d = sys.argv[1]
    prompts = torch.tensor(json.load(open(f"{d}/prompts.json"))["prompts"])
    ref = load_file(f"{d}/reference_logits.safetensors")
    ref = torch.stack([ref[f"logits_{i}"] for i in range(len(prompts))])
    out = {}
    for dtype in (torch.bfloat16, torch.float32):
        model = LlamaForCausalLM.from_pretrained(d, dtype=dtype).cuda().eval()
        with torch.no_grad():
            out[dtype] = torch.stack([model(input_ids=p[None].cuda()).logits[0].float().cpu()
                                      for p in prompts])
        del model
        torch.cuda.empty_cache()
    compare("transformers bf16 vs transformers fp32", out[torch.bfloat16], out[torch.float32])
    compare("stored reference vs transformers fp32", ref, out[torch.float32])
    torch.save(out[torch.float32], f"{d}/fp32_logits.pt")


if __name__ == "__main__":
    main()
