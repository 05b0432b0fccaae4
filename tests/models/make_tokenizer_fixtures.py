#!/usr/bin/env python3
"""Writes the tokenizer fixtures that models_tokenizer_test compares against.

Trains small tokenizers with Hugging Face `tokenizers` (and one with `sentencepiece`) on a corpus
this script writes itself, saves them in checkpoint layout, and records what the reference
libraries answer for a test corpus of >= 500 strings. Run with the system python3: it creates a
venv (--venv), installs the PyPI packages there and re-runs itself inside it. A missing PyPI is a
loud failure, never a silent skip: the C++ test is only as good as these expectations.

  python3 make_tokenizer_fixtures.py --venv BUILD/tokenizer-venv --out BUILD/.../tokenizer_fixtures
"""
import argparse
import json
import os
import random
import subprocess
import sys

PACKAGES = ["tokenizers>=0.20", "sentencepiece>=0.1.99"]

# Llama-3's pre-tokenizer split, as its tokenizer.json spells it.
LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

WORDS = ("the of and to in is that for it as was with be by on not he this are or his from at which "
         "but have an they you were her she there been one all we their has would when what will "
         "more if no out so said can who up its about into them than only other new some could time "
         "these two may then do first any my now such like our over man me even most made after also "
         "did many before must through back years where much your way well down should because each "
         "just those people how too little state good very make world still own see men work long "
         "here between both life being under never day same another know while last might us great "
         "old year off come since against go came right used take three").split()
UNICODE_WORDS = ["café", "naïve", "über", "straße", "Ångström", "señor", "façade", "crème", "brûlée",
                 "Привет", "мир", "Москва", "Ελλάδα", "καλημέρα", "שלום", "مرحبا", "العالم",
                 "नमस्ते", "दुनिया", "日本語", "東京", "こんにちは", "カタカナ", "中文", "你好世界",
                 "한국어", "안녕하세요", "ไทย", "Tiếng Việt", "İstanbul", "ǅemal", "ﬁne", "Ⅻ",
                 "x²", "½", "٣٤٥", "१२३", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢", "e\u0301", "a\u0308o\u0308"]
EMOJI = ["😀", "🎉", "👍🏽", "👨‍👩‍👧‍👦", "🇫🇷", "🇯🇵", "❤️", "🏳️‍🌈", "🤖", "🧑🏿‍💻", "✨", "🔥",
         "☃", "⌘", "🀄", "🫠", "1️⃣", "©", "™", "→", "∑", "∞", "≠", "√"]
SPACES = [" ", "  ", "   ", "\t", "\n", "\n\n", "\r\n", " \n ", "\t\t", "\u00a0", "\u3000",
          "\u2009", "\u200b", "\n   \n", "    ", " \t\n"]
CODE = [
    "def f(x):\n    return x * 2\n",
    "for (int i = 0; i < n; ++i) {\n\tsum += a[i];\n}",
    "#include <vector>\nint main() { std::vector<int> v{1, 2, 3}; }",
    "SELECT id, name FROM users WHERE age >= 21 ORDER BY name;",
    "if x != None and y == 'a':\n        print(f\"{x!r} -> {y}\")",
    "const re = /^[a-z0-9_-]{3,16}$/;\n",
    "<div class=\"main\">&nbsp;<span>Hello</span></div>",
    "{\"key\": [1, 2.5, -3e10, null, true], \"s\": \"\\u00e9\"}",
    "x = y ** 2 // 3 % 4 << 1 >> 2 & 0xff | ~z ^ w",
    "fn main() -> Result<(), Box<dyn Error>> { Ok(()) }",
    "    indented    code\t\twith   tabs  ",
    "git commit -m 'fix: handle \\r\\n' && echo $?",
]
CONTRACTIONS = ["it's", "don't", "they're", "we've", "I'm", "you'll", "he'd", "IT'S", "DON'T",
                "They'Re", "o'clock", "rock'n'roll", "'s", "''", "'''quoted'''"]


def ensure_venv(venv):
    """Re-runs this script inside `venv`, creating it and installing PACKAGES when needed."""
    py = os.path.join(venv, "bin", "python")
    if os.path.realpath(sys.prefix) == os.path.realpath(venv):
        return
    if not os.path.exists(py):
        subprocess.check_call([sys.executable, "-m", "venv", venv])
    probe = subprocess.run([py, "-c", "import tokenizers, sentencepiece"], capture_output=True)
    if probe.returncode != 0:
        print(f"make_tokenizer_fixtures: pip install {' '.join(PACKAGES)} into {venv}", flush=True)
        rc = subprocess.call([py, "-m", "pip", "install", "-q", "--disable-pip-version-check"] +
                             PACKAGES)
        if rc != 0:
            sys.exit("make_tokenizer_fixtures: FAILED to install the PyPI packages "
                     f"{PACKAGES} (is PyPI reachable?). The tokenizer test needs them.")
    os.execv(py, [py] + sys.argv)


def training_lines(rng):
    lines = []
    for _ in range(6000):
        n = rng.randint(3, 25)
        ws = [rng.choice(WORDS) for _ in range(n)]
        if rng.random() < 0.3:
            ws[0] = ws[0].capitalize()
        if rng.random() < 0.2:
            ws.insert(rng.randrange(len(ws) + 1), rng.choice(UNICODE_WORDS))
        if rng.random() < 0.1:
            ws.insert(rng.randrange(len(ws) + 1), rng.choice(CONTRACTIONS))
        if rng.random() < 0.1:
            ws.insert(rng.randrange(len(ws) + 1), str(rng.randint(0, 10**6)))
        lines.append(" ".join(ws) + rng.choice([".", ",", "!", "?", ";", ""]))
    lines += CODE * 20
    return lines


def test_corpus(rng, specials):
    """>= 500 strings; every category appears many times and the long ones run to several KB."""
    out = ["", " ", "a", "\n", "hello world", "Hello World", " leading space", "trailing space ",
           "\u0000nul", "tab\there", "12345678901234567890", "3.14159 2,718 1e-9 -42 +7 0x1F"]
    out += UNICODE_WORDS + EMOJI + SPACES + CODE + CONTRACTIONS
    for s in specials:
        out += [s, f"{s}hello", f"a{s}b", f"hello {s} world", f"{s}{s}", f" {s} ", f"{s}\n{s}"]
    pools = [WORDS, WORDS, UNICODE_WORDS, EMOJI, SPACES, CONTRACTIONS, specials,
             [str(rng.randint(0, 10**9)) for _ in range(50)], ["(", ")", "{", "}", "...", "--",
                                                               "!!", "?!", "$", "%", "#", "@"]]
    while len(out) < 560:
        n = rng.randint(1, 30)
        parts = []
        for _ in range(n):
            pool = rng.choice(pools)
            parts.append(rng.choice(pool))
            parts.append(rng.choice([" ", " ", " ", "", "\n", "  ", "\t"]))
        out.append("".join(parts))
    for i in range(12):  # long inputs
        n = 400 + 150 * i
        out.append("".join(rng.choice(WORDS + UNICODE_WORDS + EMOJI + CODE + specials) +
                           rng.choice([" ", "\n", " ", "  "]) for _ in range(n)))
    out.append(" " * 3000)
    out.append("9" * 2000)
    out.append("😀" * 500)
    return out


def random_ids(rng, vocab_size, count):
    """Arbitrary id sequences: Decode must equal HF's even where the bytes are not valid UTF-8."""
    return [[rng.randrange(vocab_size) for _ in range(rng.randint(1, 12))] for _ in range(count)]


def expectations(tok, corpus, rng):
    from tokenizers import Tokenizer  # noqa: F401  (inside the venv)
    cases = []
    for s in corpus:
        plain = tok.encode(s, add_special_tokens=False).ids
        cases.append({
            "text": s,
            "ids": plain,
            "ids_special": tok.encode(s, add_special_tokens=True).ids,
            "decode": tok.decode(plain, skip_special_tokens=False),
            "decode_skip": tok.decode(plain, skip_special_tokens=True),
        })
    decodes = []
    for ids in random_ids(rng, tok.get_vocab_size(with_added_tokens=True), 300):
        decodes.append({"ids": ids, "decode": tok.decode(ids, skip_special_tokens=False),
                        "decode_skip": tok.decode(ids, skip_special_tokens=True)})
    return {"cases": cases, "decodes": decodes}


def write_json(path, obj):
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, ensure_ascii=False, indent=1)


def byte_level_llama3(out, lines, rng):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<|start_header_id|>",
                "<|end_header_id|>"]
    tok = Tokenizer(models.BPE(ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1500, min_frequency=2, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(lines, trainer)
    tok.add_tokens(["<tool>"])  # an added token that is not special: kept by skip_special_tokens
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B",
        special_tokens=[("<|begin_of_text|>", bos)])
    os.makedirs(out, exist_ok=True)
    tok.save(os.path.join(out, "tokenizer.json"))
    write_json(os.path.join(out, "tokenizer_config.json"),
               {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"})
    eos = [tok.token_to_id("<|end_of_text|>"), tok.token_to_id("<|eot_id|>")]
    write_json(os.path.join(out, "generation_config.json"),
               {"bos_token_id": bos, "eos_token_id": eos})
    exp = expectations(tok, test_corpus(rng, specials + ["<tool>"]), rng)
    exp.update({"bos_id": bos, "eos_ids": eos,
                "specials": {s: tok.token_to_id(s) for s in specials + ["<tool>"]}})
    write_json(os.path.join(out, "expected.json"), exp)

    # The same tokenizer with its merges in the older "a b" string form (byte-level tokens never
    # hold a space: it is mapped to 'Ġ'). HF must read it to the same ids, or the fixture is wrong.
    with open(os.path.join(out, "tokenizer.json"), encoding="utf-8") as f:
        j = json.load(f)
    merges = j["model"]["merges"]
    assert merges and isinstance(merges[0], list), "tokenizers now writes merges as pairs"
    j["model"]["merges"] = [f"{a} {b}" for a, b in merges]
    out2 = out + "-string-merges"
    os.makedirs(out2, exist_ok=True)
    write_json(os.path.join(out2, "tokenizer.json"), j)
    tok2 = Tokenizer.from_file(os.path.join(out2, "tokenizer.json"))
    for c in exp["cases"][:200]:
        assert tok2.encode(c["text"], add_special_tokens=False).ids == c["ids"]
    for name in ("tokenizer_config.json", "generation_config.json", "expected.json"):
        with open(os.path.join(out, name), "rb") as src, open(os.path.join(out2, name), "wb") as d:
            d.write(src.read())


def sentencepiece_style(out, lines, rng):
    """Llama-2's tokenizer.json as transformers converts it: Prepend/Replace normalizer, no
    pre-tokenizer, BPE with byte_fallback, decoder Replace/ByteFallback/Fuse/Strip."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from tokenizers import trainers
    byte_tokens = [f"<0x{i:02X}>" for i in range(256)]
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    # Trained on words so that no merge spans a '▁' boundary, as in SentencePiece's models.
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never")
    trainer = trainers.BpeTrainer(vocab_size=1200, min_frequency=2, limit_alphabet=120,
                                  special_tokens=["<unk>", "<s>", "</s>"] + byte_tokens,
                                  show_progress=False)
    tok.train_from_iterator(lines, trainer)
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "tokenizer.json")
    tok.save(path)
    with open(path, encoding="utf-8") as f:
        j = json.load(f)
    j["pre_tokenizer"] = None
    # Llama-2's byte tokens are plain vocab entries, not added tokens.
    j["added_tokens"] = [t for t in j["added_tokens"] if t["content"] not in byte_tokens]
    write_json(path, j)
    tok = Tokenizer.from_file(path)
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)])
    tok.save(path)
    write_json(os.path.join(out, "tokenizer_config.json"),
               {"bos_token": {"content": "<s>"}, "eos_token": {"content": "</s>"},
                "add_bos_token": True})
    eos = tok.token_to_id("</s>")
    exp = expectations(tok, test_corpus(rng, ["<s>", "</s>", "<unk>"]), rng)
    exp.update({"bos_id": bos, "eos_ids": [eos],
                "specials": {s: tok.token_to_id(s) for s in ["<s>", "</s>", "<unk>"]}})
    write_json(os.path.join(out, "expected.json"), exp)


def sentencepiece_model(out, lines, rng):
    import sentencepiece as spm
    os.makedirs(out, exist_ok=True)
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_prefix=os.path.join(out, "tokenizer"),
        vocab_size=800, model_type="bpe", byte_fallback=True, character_coverage=0.995,
        minloglevel=2)
    os.remove(os.path.join(out, "tokenizer.vocab"))
    sp = spm.SentencePieceProcessor(model_file=os.path.join(out, "tokenizer.model"))
    cases = []
    for s in test_corpus(rng, ["<s>", "</s>"]):
        ids = sp.encode(s)
        cases.append({"text": s, "ids": ids, "ids_special": [sp.bos_id()] + ids,
                      "decode": sp.decode(ids)})
    write_json(os.path.join(out, "expected.json"),
               {"cases": cases, "bos_id": sp.bos_id(), "eos_ids": [sp.eos_id()]})


def shipped_default(out, rng):
    """The tokenizer shipped with models/default, held to the same corpus as the generated ones."""
    from tokenizers import Tokenizer
    src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "models", "default")
    os.makedirs(out, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        with open(os.path.join(src, name), "rb") as f, open(os.path.join(out, name), "wb") as d:
            d.write(f.read())
    tok = Tokenizer.from_file(os.path.join(out, "tokenizer.json"))
    specials = [t.content for t in tok.get_added_tokens_decoder().values() if t.special]
    with open(os.path.join(out, "generation_config.json"), encoding="utf-8") as f:
        gen = json.load(f)
    eos = gen["eos_token_id"] if isinstance(gen["eos_token_id"], list) else [gen["eos_token_id"]]
    exp = expectations(tok, test_corpus(rng, specials), rng)
    exp.update({"bos_id": gen["bos_token_id"], "eos_ids": eos,
                "specials": {s: tok.token_to_id(s) for s in specials}})
    write_json(os.path.join(out, "expected.json"), exp)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--venv", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    ensure_venv(os.path.abspath(args.venv))
    lines = training_lines(random.Random(1234))
    byte_level_llama3(os.path.join(args.out, "bytelevel-llama3"), lines, random.Random(1))
    sentencepiece_style(os.path.join(args.out, "sentencepiece-bpe"), lines, random.Random(2))
    sentencepiece_model(os.path.join(args.out, "sentencepiece-model"), lines, random.Random(3))
    shipped_default(os.path.join(args.out, "shipped-default"), random.Random(4))
    print(f"make_tokenizer_fixtures: wrote {args.out}")


if __name__ == "__main__":
    main()
