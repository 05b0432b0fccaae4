#!/usr/bin/env python3
"""How closely does transformers agree with itself on the Llama-1B-shape reference? Loads <dir>
(written by make_llama_reference.py --shape 1b) and runs the same prompts teacher-forced in several
configurations that all round to bf16 at the same points as the stored reference (transformers
bf16, sdpa, on the GPU) but differ in kernels or in precision:

  - bf16 on the GPU with cuBLAS's reduced-precision (bf16) split-K reductions disallowed;
  - bf16 on the GPU with eager attention (bf16 scores and probabilities) instead of sdpa;
  - bf16 on the CPU (other GEMM kernels, other summation order);
  - fp32 on the GPU.

Each is compared with the stored reference (top-1 agreement as engine_cuda_hf_logits_test
counts it, relative and max error): the noise floor the test's numbers should be read against.

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
    print(f"{name:58s} top-1 agreement {100 * agree:6.2f}%, rel err {rel:.3e}, "
          f"max |err| {(a - b).abs().max().item():.4f}", flush=True)


def run(d, prompts, dtype, device="cuda", attn="sdpa"):
    model = LlamaForCausalLM.from_pretrained(d, dtype=dtype, attn_implementation=attn)
    model = model.to(device).eval()
    with torch.no_grad():
        out = torch.stack([model(input_ids=p[None].to(device)).logits[0].float().cpu()
                           for p in prompts])
    del model
    torch.cuda.empty_cache()
    return out


def main():
    d = sys.argv[1]
    prompts = torch.tensor(json.load(open(f"{d}/prompts.json"))["prompts"])
    ref = load_file(f"{d}/reference_logits.safetensors")
    ref = torch.stack([ref[f"logits_{i}"] for i in range(len(prompts))])
    compare("transformers bf16 sdpa GPU (rerun) vs stored reference",
            run(d, prompts, torch.bfloat16), ref)
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    compare("bf16 GPU, no reduced-precision reduction vs reference",
            run(d, prompts, torch.bfloat16), ref)
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = True
    compare("bf16 GPU, eager attention vs reference",
            run(d, prompts, torch.bfloat16, attn="eager"), ref)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    compare("bf16 CPU (sdpa) vs reference", run(d, prompts, torch.bfloat16, device="cpu"), ref)
    fp32 = run(d, prompts, torch.float32)
    compare("fp32 GPU vs reference", fp32, ref)
    torch.save(fp32, f"{d}/fp32_logits.pt")


if __name__ == "__main__":
    main()
