"""Screening of low-bit key and value codes on a real model, before any storage implements them.

Each method quantizes every chunk's keys and values as they enter a dense cache and reads them
straight back, so the cache holds what the method's codes would give, at full precision: the
methods of the literature (rotations, Lloyd-Max codebooks, keys before RoPE, full-precision
sinks, dense-and-sparse outliers) can be compared on the streaming protocol of
``benchmarks/agreement.py`` (the next-token argmax and perplexity against one full-precision
forward over the same tokens) before one is built. Their size is counted from the method's
definition, in bits per stored element: codes, fp16 scales and zero points, codebook scales,
the float32 sinks and outliers (value and index), and the dense cache's int16 positions; KIVI's
full-precision residual is not simulated (every chunk of 256 tokens fills whole key groups).

A method is ``keys,values[,modifier...]``; a part is
    full         unquantized
    tok<b>[/g]   per token, uniform min-max over groups of g channels (default: the head)
    ch<b>/<G>    per channel over groups of G consecutive tokens (KIVI's keys)
    pch<b>/<G>   as ch, on keys taken back before RoPE (un-rotated at their position, re-rotated)
    rtok<b>      a Hadamard rotation of the head, then per token uniform
    rcb<b>       a Hadamard rotation, then each coordinate coded by the Lloyd-Max codebook of a
                 standard normal, scaled per token by a least-squares fp16 factor
and a modifier applies to both:
    s<n>         the first n tokens kept at full precision (attention sinks)
    o<p>         per token, the p percent of elements largest in magnitude kept exactly
    x            a chunk attends its own tokens at full precision, and later chunks read them
                 coded (as KIVI attends a prompt before quantizing it: no stored bits, but the
                 result then depends on the chunking)

    python benchmarks/kv_screen.py --model smollm2 [--methods tok4,tok4 ch4/64,rcb4 ...]
                                   [--texts emma,hamlet] [--tokens 4096] [--chunk 256]

Prints one JSON object (per text and method: top-1 agreement, KL, perplexity over dense, bits
per element); progress on stderr. float32, one thread.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import re
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from agreement import resolve
from emit import emit

import kvcache
from kvcache.cache.registry import make_cache
from kvcache.cache.storages.full import FullStorage
from kvcache.eval.quality import reference_logprobs
from kvcache.eval.tasks import DEFAULT_TEXTS, read_texts
from kvcache.model.rope import apply_rope, rope_angles
from kvcache.runtime.threads import set_threads

DEFAULT_METHODS = [
    "tok4,tok4", "ch4/64,tok4", "ch4/64,full", "full,tok4", "full,rtok4", "full,rcb4",
    "ch4/64,rcb4", "pch4/64,rcb4", "pch4/64,rcb4,s4", "ch4/32,rcb4,s4", "pch4/64,rcb4,o1",
    "pch3/64,rcb3,s4", "ch3/64,rcb3,s4", "pch4/64,rcb3,s4", "pch3/64,rcb4,s4",
    "pch2/64,rcb2,s4", "pch2/32,rcb2,s4", "pch2/64,rcb3,s4", "pch3/32,rcb2,s4",
]
_PART = re.compile(r"(full)|(tok|ch|pch|rtok|rcb)(\d)(?:/(\d+))?")
FP16_BITS = 16
FLOAT32_BITS = 32
POSITION_BITS = 16  # a dense cache's int16 positions, one per token and layer


def log(*args) -> None:
    print(*args, file=sys.stderr, flush=True)


@functools.cache
def hadamard(n: int) -> torch.Tensor:
    """(n, n) orthonormal Sylvester Hadamard matrix (n a power of two)."""
    if n & (n - 1):
        raise SystemExit(f"rotations need a power-of-two head_dim, got {n}")
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return h / math.sqrt(n)


@functools.cache
def lloyd_max(bits: int, iterations: int = 200) -> torch.Tensor:
    """The 2^bits reconstruction levels minimizing the squared error of a standard normal,
    by Lloyd's iterations on its quantiles (deterministic)."""
    x = torch.distributions.Normal(0.0, 1.0).icdf(torch.linspace(0.5, 2**17 - 0.5, 2**17) / 2**17).double()
    levels = torch.quantile(x, (torch.arange(2**bits).double() + 0.5) / 2**bits)
    for _ in range(iterations):
        edges = (levels[1:] + levels[:-1]) / 2
        cell = torch.bucketize(x, edges)
        levels = torch.zeros_like(levels).index_add_(0, cell, x) / torch.bincount(cell, minlength=2**bits)
    return levels.float()


def fp16(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-65504, 65504).half().float()


def uniform(x: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Asymmetric min-max codes over ``dim`` with fp16 scale and zero, read back."""
    lo, hi = fp16(x.amin(dim, keepdim=True)), x.amax(dim, keepdim=True)
    scale = fp16((hi - lo) / (2**bits - 1)).clamp_min(1e-8)
    return ((x - lo) / scale).round().clamp(0, 2**bits - 1) * scale + lo


@dataclass(frozen=True)
class Part:
    """How one of keys or values is coded (module docstring)."""

    kind: str  # full, tok, ch, pch, rtok, rcb
    bits: int = 32
    group: int | None = None

    @classmethod
    def parse(cls, text: str) -> Part:
        m = _PART.fullmatch(text)
        if m is None:
            raise SystemExit(f"unknown part {text!r}: full, tok<b>[/g], ch<b>/<G>, pch<b>/<G>, rtok<b>, rcb<b>")
        if m.group(1):
            return cls("full")
        kind, bits, group = m.group(2), int(m.group(3)), m.group(4)
        if kind in ("ch", "pch") and group is None:
            raise SystemExit(f"{text!r}: per-channel parts name their token group, e.g. {kind}{bits}/64")
        return cls(kind, bits, None if group is None else int(group))

    def bits_per_element(self, head_dim: int) -> float:
        """Codes plus metadata per element (fp16 scale and zero per group; one fp16 scale per token
        for a codebook)."""
        if self.kind == "full":
            return FLOAT32_BITS
        if self.kind == "rcb":
            return self.bits + FP16_BITS / head_dim
        if self.kind in ("ch", "pch"):
            return self.bits + 2 * FP16_BITS / self.group
        return self.bits + 2 * FP16_BITS / (self.group or head_dim)


class Coder:
    """Quantize-and-read-back of x (B, H, T, D) float32 for one part; ``rope``: (cos, sin) of the
    tokens' positions (T, D), for keys coded before RoPE."""

    def __init__(self, part: Part, head_dim: int) -> None:
        self.part = part
        self.rotation = hadamard(head_dim) if part.kind in ("rtok", "rcb") else None
        self.levels = lloyd_max(part.bits) if part.kind == "rcb" else None

    def __call__(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        p = self.part
        if p.kind == "full":
            return x
        if p.kind == "tok":
            g = x.unflatten(-1, (-1, p.group or x.shape[-1]))
            return uniform(g, p.bits, -1).flatten(-2)
        if p.kind in ("ch", "pch"):
            if p.kind == "pch":
                cos, sin = rope
                x = apply_rope(x, cos, -sin)
            T = x.shape[2]
            if T % p.group:
                raise SystemExit(f"chunks of {T} tokens do not fill groups of {p.group}: pick --chunk a multiple")
            y = uniform(x.unflatten(2, (-1, p.group)), p.bits, 3).flatten(2, 3)
            return apply_rope(y, cos, sin) if p.kind == "pch" else y
        r = x @ self.rotation
        if p.kind == "rtok":
            y = uniform(r, p.bits, -1)
        else:
            rms = r.square().mean(-1, keepdim=True).sqrt().clamp_min(1e-8)
            u = self.levels[torch.bucketize(r / rms, (self.levels[1:] + self.levels[:-1]) / 2)]
            # The least-squares factor of the unit codes, rounded to fp16 as stored.
            t = fp16((r * u).sum(-1, keepdim=True) / u.square().sum(-1, keepdim=True).clamp_min(1e-12))
            y = u * t
        return y @ self.rotation.T


@dataclass(frozen=True)
class Method:
    keys: Part
    values: Part
    sinks: int = 0
    outliers: float = 0.0  # percent of each token's elements kept exactly
    exact_chunk: bool = False

    @classmethod
    def parse(cls, text: str) -> Method:
        parts = text.split(",")
        if len(parts) < 2:
            raise SystemExit(f"method {text!r}: keys,values[,s<n>][,o<p>][,x]")
        sinks, outliers, exact_chunk = 0, 0.0, False
        for mod in parts[2:]:
            if mod == "x":
                exact_chunk = True
            elif re.fullmatch(r"s\d+", mod):
                sinks = int(mod[1:])
            elif re.fullmatch(r"o\d+(\.\d+)?", mod):
                outliers = float(mod[1:])
            else:
                raise SystemExit(f"method {text!r}: unknown modifier {mod!r} (s<n>, o<p>, x)")
        return cls(Part.parse(parts[0]), Part.parse(parts[1]), sinks, outliers, exact_chunk)

    def bits_per_element(self, head_dim: int, kv_heads: int, tokens: int) -> float:
        """What the codes would hold, per element of the keys and values, over ``tokens`` tokens."""
        coded = (self.keys.bits_per_element(head_dim) + self.values.bits_per_element(head_dim)) / 2
        sink_share = min(self.sinks, tokens) / tokens
        # An outlier: its float32 value, a byte for its channel, and its code still stored.
        outlier = self.outliers / 100 * (FLOAT32_BITS + 8) if self.outliers else 0.0
        per = (1 - sink_share) * (coded + outlier) + sink_share * FLOAT32_BITS
        return per + POSITION_BITS / (2 * kv_heads * head_dim)


class Simulated(FullStorage):
    """A dense cache's full-precision slots that receive each chunk as ``method`` codes it (its
    ``roundtrip``, which a dense cache stores and attends). Batch 1, one prompt fed from position
    0 in order, so a token's position is the count of those before it. With ``exact_chunk`` the
    chunk is stored and attended as it is, and coded in place when the next chunk arrives."""

    def __init__(self, spec, method: Method, coders: tuple[Coder, Coder], inv_freq: torch.Tensor | None) -> None:
        super().__init__(spec, limit=spec.cache_length)
        self.method, self.coders, self.inv_freq = method, coders, inv_freq
        self.seen = 0
        self.last = (0, 0)  # the slots of the chunk stored exactly (exact_chunk)

    def roundtrip(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        start = self.seen
        self.seen += k.shape[2]
        if not self.method.exact_chunk:
            return self.code(k, v, start)
        s0, s1 = self.last
        if s1 > s0:
            self.k[:, :, s0:s1], self.v[:, :, s0:s1] = self.code(self.k[:, :, s0:s1], self.v[:, :, s0:s1], s0)
        self.last = (start, self.seen)
        return k, v

    def code(self, k: torch.Tensor, v: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v (1, H, T, D) of positions [start, start + T) as the method reads them back."""
        positions = torch.arange(start, start + k.shape[2])
        rope = None if self.inv_freq is None else rope_angles(self.inv_freq, positions, torch.float32)
        out = []
        for x, coder in zip((k.float(), v.float()), self.coders):
            y = coder(x, rope)
            if self.method.outliers:
                n = max(1, round(x.shape[-1] * self.method.outliers / 100))
                top = x.abs().topk(n, dim=-1).indices
                y = y.scatter(-1, top, x.gather(-1, top))
            if self.method.sinks:
                keep = (positions < self.method.sinks)[:, None]
                y = torch.where(keep, x, y)
            out.append(y.to(k.dtype))
        return out[0], out[1]


def run(model, ids: torch.Tensor, method: Method, chunk: int, reference: torch.Tensor) -> dict:
    """The streaming protocol over ``ids`` (N,) with every layer's slots coded by ``method``."""
    N = ids.shape[0]
    cache = make_cache(model, "dense", cache_length=N)
    for i, layer in enumerate(cache.layers):
        needs_rope = method.keys.kind == "pch"
        inv_freq = model.rotary(i) if needs_rope else None
        if needs_rope and inv_freq is None:
            raise SystemExit("keys before RoPE need fixed rotary frequencies")
        coders = (Coder(method.keys, layer.spec.head_dim), Coder(method.values, layer.spec.head_dim))
        layer.storage = Simulated(layer.spec, method, coders, inv_freq)
    with torch.inference_mode():
        logits = torch.cat([model(ids[None, i : i + chunk], cache)[0] for i in range(0, N, chunk)])
    logp = torch.log_softmax(logits[:-1].float(), -1)
    nll = -logp.gather(1, ids[1:, None]).mean().item()
    kl = max(0.0, (reference.exp() * (reference - logp)).sum(-1).mean().item())
    spec = cache.layers[0].spec
    return {"top1_agreement": (logp.argmax(-1) == reference.argmax(-1)).float().mean().item(),
            "perplexity": math.exp(nll), "kl": kl,
            "bits_per_element": method.bits_per_element(spec.head_dim, spec.num_kv_heads, N)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2", help="checkpoint, GGUF file or known model (default: smollm2)")
    p.add_argument("--methods", nargs="+", default=DEFAULT_METHODS)
    p.add_argument("--texts", default="emma", help="comma-separated parts of packaged text names (default: emma)")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", help="also write the JSON here")
    args = p.parse_args()
    methods = {m: Method.parse(m) for m in args.methods}  # every name checked before any run
    set_threads(args.threads)
    checkpoint = resolve(args.model)
    model = kvcache.load(checkpoint, dtype=torch.float32)
    tokenizer = kvcache.load_tokenizer(checkpoint)
    wanted = [t.strip() for t in args.texts.split(",") if t.strip()]
    paths = [q for q in sorted(DEFAULT_TEXTS.glob("*.txt")) if any(w in q.stem for w in wanted)]
    if not paths:
        raise SystemExit(f"--texts {args.texts!r} names none of {[q.stem for q in DEFAULT_TEXTS.glob('*.txt')]}")
    report = {"model": args.model, "tokens": args.tokens, "chunk": args.chunk, "torch": torch.__version__,
              "results": []}
    for path in paths:
        with tempfile.TemporaryDirectory() as one:
            (Path(one) / path.name).write_text(path.read_text())
            ids = read_texts(one, tokenizer)[: args.tokens]
        reference = reference_logprobs(model, ids, ids.shape[0])
        dense = run(model, ids, Method.parse("full,full"), args.chunk, reference)
        for name, method in methods.items():
            start = time.perf_counter()
            r = run(model, ids, method, args.chunk, reference)
            row = {"text": path.stem, "method": name, "top1_agreement": round(r["top1_agreement"], 4),
                   "perplexity_over_dense": round(r["perplexity"] / dense["perplexity"], 4), "kl": round(r["kl"], 5),
                   "bits_per_element": round(r["bits_per_element"], 3), "seconds": round(time.perf_counter() - start, 1)}
            report["results"].append(row)
            log(json.dumps(row))
    emit(report, args.out, indent=1)


if __name__ == "__main__":
    main()
