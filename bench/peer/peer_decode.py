#!/usr/bin/env python3
"""The peer we measure tailserve against: a gpt-fast-style Llama decode loop in PyTorch with a
static KV cache, compiled with torch.compile(mode="reduce-overhead", fullgraph=True), greedy.

Random bf16 weights in real Llama shapes; a 128-token prompt, then N decode steps. Prints one JSON
line per (shape, batch) with the median time per decode step measured with CUDA events.

  python3 bench/peer/peer_decode.py --shapes 1b,8b --batches 1,8,16,32,64,128 --out peer.jsonl
"""
import argparse
import json
import math
import statistics
import time

import torch
import torch.nn.functional as F

SHAPES = {
    # hidden, intermediate, layers, heads, kv_heads, vocab, rope_theta
    "1b": dict(hidden=2048, inter=8192, layers=16, heads=32, kv=8, vocab=128256, theta=500000.0),
    "8b": dict(hidden=4096, inter=14336, layers=32, heads=32, kv=8, vocab=128256, theta=500000.0),
}


class KVCache(torch.nn.Module):
    def __init__(self, batch, max_len, kv_heads, head_dim, dtype):
        super().__init__()
        shape = (batch, kv_heads, max_len, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype), persistent=False)

    def update(self, pos, k, v):
        # pos: [S]; k, v: [B, Hkv, S, D]
        self.k.index_copy_(2, pos, k)
        self.v.index_copy_(2, pos, v)
        return self.k, self.v


class Layer(torch.nn.Module):
    def __init__(self, c, dtype):
        super().__init__()
        h, d = c["hidden"], c["hidden"] // c["heads"]
        self.heads, self.kv, self.d = c["heads"], c["kv"], d
        self.wqkv = torch.nn.Linear(h, (c["heads"] + 2 * c["kv"]) * d, bias=False, dtype=dtype)
        self.wo = torch.nn.Linear(c["heads"] * d, h, bias=False, dtype=dtype)
        self.w13 = torch.nn.Linear(h, 2 * c["inter"], bias=False, dtype=dtype)
        self.w2 = torch.nn.Linear(c["inter"], h, bias=False, dtype=dtype)
        self.n1 = torch.nn.RMSNorm(h, eps=1e-5, dtype=dtype)
        self.n2 = torch.nn.RMSNorm(h, eps=1e-5, dtype=dtype)
        self.cache = None

    def forward(self, x, cos, sin, pos, mask):
        b, s, _ = x.shape
        q, k, v = self.wqkv(self.n1(x)).split(
            [self.heads * self.d, self.kv * self.d, self.kv * self.d], dim=-1)
        q = q.view(b, s, self.heads, self.d).transpose(1, 2)
        k = k.view(b, s, self.kv, self.d).transpose(1, 2)
        v = v.view(b, s, self.kv, self.d).transpose(1, 2)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        k, v = self.cache.update(pos, k, v)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        x = x + self.wo(o.transpose(1, 2).reshape(b, s, -1))
        g, u = self.w13(self.n2(x)).chunk(2, dim=-1)
        return x + self.w2(F.silu(g) * u)


def rope(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Model(torch.nn.Module):
    def __init__(self, c, dtype):
        super().__init__()
        self.c = c
        self.embed = torch.nn.Embedding(c["vocab"], c["hidden"], dtype=dtype)
        self.layers = torch.nn.ModuleList(Layer(c, dtype) for _ in range(c["layers"]))
        self.norm = torch.nn.RMSNorm(c["hidden"], eps=1e-5, dtype=dtype)
        self.lm_head = torch.nn.Linear(c["hidden"], c["vocab"], bias=False, dtype=dtype)
        d = c["hidden"] // c["heads"]
        self.inv_freq = 1.0 / (c["theta"] ** (torch.arange(0, d, 2, dtype=torch.float32) / d))

    def setup_cache(self, batch, max_len, device):
        d = self.c["hidden"] // self.c["heads"]
        for layer in self.layers:
            layer.cache = KVCache(batch, max_len, self.c["kv"], d, self.embed.weight.dtype).to(device)
        inv_freq = self.inv_freq.to(device)
        t = torch.arange(max_len, dtype=torch.float32, device=device)
        f = torch.outer(t, inv_freq)
        emb = torch.cat((f, f), dim=-1)
        self.cos = emb.cos().to(device, self.embed.weight.dtype)
        self.sin = emb.sin().to(device, self.embed.weight.dtype)
        self.causal = torch.tril(torch.ones(max_len, max_len, dtype=torch.bool, device=device))

    def forward(self, tokens, pos):
        x = self.embed(tokens)
        cos, sin = self.cos[pos], self.sin[pos]
        mask = self.causal[pos].view(1, 1, pos.shape[0], -1)
        for layer in self.layers:
            x = layer(x, cos, sin, pos, mask)
        return self.lm_head(self.norm(x[:, -1:]))


def decode_one(model, tok, pos):
    return model(tok, pos).argmax(dim=-1)


def weight_bytes(c):
    d = c["hidden"] // c["heads"]
    per_layer = c["hidden"] * (c["heads"] + 2 * c["kv"]) * d + c["heads"] * d * c["hidden"] \
        + 3 * c["hidden"] * c["inter"] + 2 * c["hidden"]
    return 2 * (c["layers"] * per_layer + 2 * c["vocab"] * c["hidden"] + c["hidden"])


def run(shape, batch, prompt_len, new_tokens, device):
    c = SHAPES[shape]
    torch.manual_seed(0)
    with torch.device(device):
        model = Model(c, torch.bfloat16)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02)
    model.setup_cache(batch, prompt_len + new_tokens, device)
    model.eval()
    # Each (shape, batch) compiles afresh: its graphs would otherwise count against dynamo's
    # recompile limit (8), which fullgraph=True turns into a hard failure at the ninth.
    torch._dynamo.reset()
    step = torch.compile(decode_one, mode="reduce-overhead", fullgraph=True)
    tokens = torch.randint(0, c["vocab"], (batch, prompt_len), device=device)
    with torch.no_grad():
        tok = model(tokens, torch.arange(prompt_len, device=device)).argmax(dim=-1)
        t0 = time.time()
        for i in range(3):  # compile + cudagraph warm-up
            tok = step(model, tok, torch.tensor([prompt_len + i], device=device)).clone()
        compile_s = time.time() - t0
        times = []
        for i in range(3, new_tokens):
            pos = torch.tensor([prompt_len + i], device=device)
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            tok = step(model, tok, pos).clone()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
    ms = statistics.median(times)
    return dict(peer="torch.compile-reduce-overhead", shape=shape, batch=batch,
                prompt_len=prompt_len, new_tokens=new_tokens, ms_per_step=ms,
                tokens_per_s=batch * 1000.0 / ms, weight_bytes=weight_bytes(c),
                compile_s=compile_s, torch=torch.__version__, gpu=torch.cuda.get_device_name())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="1b,8b")
    ap.add_argument("--batches", default="1,8,16,32,64,128")
    ap.add_argument("--prompt_len", type=int, default=128)
    ap.add_argument("--new_tokens", type=int, default=256)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    out = open(args.out, "a") if args.out else None
    for shape in args.shapes.split(","):
        for batch in [int(b) for b in args.batches.split(",")]:
            r = run(shape, batch, args.prompt_len, args.new_tokens, "cuda")
            line = json.dumps(r)
            print(line, flush=True)
            if out:
                out.write(line + "\n")
                out.flush()
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
