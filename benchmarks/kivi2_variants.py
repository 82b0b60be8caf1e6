"""2-bit KIVI variants screened on the bundled model, without changing the storage.

The held-out text (``kvcache eval``'s) is teacher-forced through the model in one pass, and each
layer's attention is replaced by one that reads what a 2-bit KIVI dense cache would give each
query: a slot's key and value decoded from its codes where the slot's group of 64 was sealed at
or before the query (its last slot written), at full precision otherwise (the residual, and the
staged copies a chunk's queries read). Keys per channel over each group, values per token, codes
from kvcache/quant/codes.py. Top-1 agreement and KL(dense || variant) of the next-token
distributions over every position, against the same model with full-precision attention, and
perplexity. ``base`` (the clipped key groups with values in one group) is the peer, in the same
run; ``kivi2`` is what the storage does now (per-key scales, values in 4 groups), which
``kvcache eval --policies dense:int2 --stream-tokens 4096`` reproduces (93.48%, KL 0.0098).

A variant is options joined by ``+`` (docs/quantized.md, 2-bit section):

    keys:    (default) per channel in clipped ranges   kmm      min-max ranges
             kscale   a scale per key, refitted (the storage's, ``quantize_scaled``); with
                      kls, or kalt (scale and codes alternated 3 times), computed here
             krms     a scale per key: its root mean square, no refit
             kpre     per channel before RoPE           krot     rotated (Hadamard), per channel
             krottok  rotated, per token                 k4       4-bit per channel
             kls      ranges refitted by 3 least-squares (Lloyd) steps after the clipped choice
             koff     a scale and an offset per key, fitted by least squares to the decoded codes
             kpre+kscale  per channel before RoPE, with a scale per key
             kfull    full precision
    values:  (default) per token, one group             vg4      4 groups of channels
             vrot     rotated (Hadamard) before the codes, back after
             vclip    clipped ranges                    v4       4-bit   vfull  full precision
    sinkN    the first N tokens' keys and values at full precision
    L<i>=<option>  an option for layer i only (``L3=k4``)

    python benchmarks/kivi2_variants.py [--tokens 4096] [--variants base,kivi2,kscale,vg4,...]
        [--seed 0] [--threads 1] [--text shakespeare__hamlet]

Prints one JSON object. CPU, about 10 s a variant at 4096 tokens.
"""

from __future__ import annotations

import argparse
import json
import math

import torch
import torch.nn.functional as F

from kvcache.checkpoints.load import load, load_tokenizer
from kvcache.eval.tasks import read_texts
from kvcache.model import transformer as model_module
from kvcache.model.rope import apply_rope
from kvcache.quant.codes import decode_tokens, encode_tokens, key_clip, quantize, quantize_scaled
from kvcache.runtime.threads import set_threads

GROUP = 64  # slots per key group, as kivi2's
BITS = 2
DEFAULT = ("base,kivi2,kmm,kscale,krms,kscale+kalt,kscale+kls+vg4,vg4,vrot,vrot+vg4,krot,krottok,kpre,kpre+vrot,"
           "kpre+kls+vrot+vg4,kls,kscale+vrot,kscale+vrot+vg4,sink64")


def hadamard(d: int, seed: int) -> torch.Tensor:
    """A normalised Hadamard matrix with rows of random sign: orthogonal (x @ R, back: @ R.T)."""
    h = torch.ones(1, 1)
    while h.shape[0] < d:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    sign = torch.randint(0, 2, (d,), generator=torch.Generator().manual_seed(seed)).float() * 2 - 1
    return sign[:, None] * h / math.sqrt(d)


def lloyd(x, q, scale, zero, dim, steps):
    """Least-squares scale and zero point of the codes, then the codes again, ``steps`` times,
    each group keeping its best: the reading (float32)."""
    best_s, best_z, qf = scale.float(), zero.float(), q.float()
    best = (qf * best_s + best_z - x).square().sum(dim, keepdim=True)
    for _ in range(steps):
        mq, mx = qf.mean(dim, keepdim=True), x.mean(dim, keepdim=True)
        var = (qf - mq).square().sum(dim, keepdim=True)
        s = torch.where(var > 0, ((qf - mq) * (x - mx)).sum(dim, keepdim=True) / var.clamp(min=1e-30), best_s)
        s = s.clamp(min=0).half().float()
        z = (mx - s * mq).half().float()
        qf = ((x - z) / torch.where(s > 0, s, 1.0)).round().clamp(0, 2**BITS - 1)
        err = (qf * s + z - x).square().sum(dim, keepdim=True)
        better = err < best
        best, best_s, best_z = torch.where(better, err, best), torch.where(better, s, best_s), torch.where(better, z, best_z)
    qf = ((x - best_z) / torch.where(best_s > 0, best_s, 1.0)).round().clamp(0, 2**BITS - 1)
    return qf * best_s + best_z


def per_channel(x: torch.Tensor, clip: bool = True, bits: int = BITS, ls: bool = False) -> torch.Tensor:
    """Keys (B, H, T, D), T a multiple of GROUP, read back from per-channel codes over groups."""
    B, H, T, D = x.shape
    g = x.float().view(B, H, T // GROUP, GROUP, D)
    q, scale, zero = quantize(g, bits, dim=3, clip=key_clip(bits) if clip else ())
    out = lloyd(g, q, scale, zero, 3, 3) if ls else q.float() * scale.float() + zero.float()
    return out.view(B, H, T, D)


def per_token(x: torch.Tensor, group: int | None = None, bits: int = BITS, clip=()) -> torch.Tensor:
    codes, meta = encode_tokens(x, bits, group or x.shape[-1], clip=clip)
    return decode_tokens(codes, meta, bits, torch.float32)


def read_back(opts: set[str], k, k_pre, v, cos, sin, rot) -> tuple[torch.Tensor, torch.Tensor]:
    """What a query reads from a sealed slot: keys (after RoPE) and values, (B, H, T, D)."""
    B, H, T, D = k.shape
    if "kivi2" in opts:
        opts = opts | {"kscale", "vg4"}
    if "kfull" in opts:
        kh = k
    elif "kpre" in opts and "kscale" in opts:
        q, scale, zero, t = quantize_scaled(k_pre.reshape(B, H, T // GROUP, GROUP, D), BITS, clip=key_clip(BITS))
        kh = apply_rope(((q.float() * scale.float() + zero.float()) * t.float()).view(B, H, T, D), cos, sin)
    elif "kpre" in opts:
        kh = apply_rope(per_channel(k_pre, ls="kls" in opts), cos, sin)
    elif "koff" in opts:
        # A scale and an offset per key (the second fp16 a per-channel key's meta leaves unused):
        # the least-squares fit of the key to its decoded codes u, key ~ t u + o.
        q, scale, zero, t = quantize_scaled(k.view(B, H, T // GROUP, GROUP, D), BITS, clip=key_clip(BITS))
        u = (q.float() * scale.float() + zero.float()).view(B, H, T, D)
        mu, mk = u.mean(-1, keepdim=True), k.mean(-1, keepdim=True)
        var = (u - mu).square().sum(-1, keepdim=True)
        a = ((u - mu) * (k - mk)).sum(-1, keepdim=True) / var.clamp(min=1e-30)
        a = torch.where((var > 0) & (a > 0), a, t.float().view(B, H, T, 1)).half().float()
        o = (mk - a * mu).half().float()
        kh = u * a + o
    elif "krottok" in opts:
        kh = per_token(k @ rot) @ rot.T
    elif "krot" in opts:
        kh = per_channel(k @ rot) @ rot.T
    elif "k4" in opts:
        kh = per_channel(k, clip=False, bits=4)
    elif "kmm" in opts:
        kh = per_channel(k, clip=False)
    elif "kscale" in opts and ("kls" in opts or "kalt" in opts):
        # The per-key scale, with least-squares ranges, or scale and codes alternated 3 times.
        t = k.square().mean(-1, keepdim=True).sqrt().clamp(min=2.0**-14).half().float()
        u = per_channel(k / t, ls="kls" in opts)
        steps = 3 if "kalt" in opts else 1
        for i in range(steps):
            fit = (k * u).sum(-1, keepdim=True) / u.square().sum(-1, keepdim=True)
            t = torch.where(torch.isfinite(fit) & (fit > 0), fit, t).half().float()
            if i + 1 < steps:
                u = per_channel(k / t, ls="kls" in opts)
        kh = u * t
    elif "kscale" in opts:
        q, scale, zero, t = quantize_scaled(k.view(B, H, T // GROUP, GROUP, D), BITS, clip=key_clip(BITS))
        kh = ((q.float() * scale.float() + zero.float()) * t.float()).view(B, H, T, D)
    elif "krms" in opts:
        rms = k.square().mean(-1, keepdim=True).sqrt().clamp(min=2.0**-14).half().float()
        kh = per_channel(k / rms) * rms
    else:
        kh = per_channel(k, ls="kls" in opts)
    group = D // 4 if "vg4" in opts else None
    clip = key_clip(BITS) if "vclip" in opts else ()
    if "vfull" in opts:
        vh = v
    elif "v4" in opts:
        vh = per_token(v, bits=4)
    elif "vrot" in opts:
        vh = per_token(v @ rot, group, clip=clip) @ rot.T
    else:
        vh = per_token(v, group, clip=clip)
    for o in opts:
        if o.startswith("sink"):
            n = int(o[4:])
            kh, vh = torch.cat((k[:, :, :n], kh[:, :, n:]), 2), torch.cat((v[:, :, :n], vh[:, :, n:]), 2)
    return kh, vh


def attend(q, k, v, kh, vh) -> torch.Tensor:
    """Causal attention, each query reading a slot from (kh, vh) once its group is sealed."""
    B, Hq, T, D = q.shape
    rep = Hq // k.shape[1]
    k, v, kh, vh = (x.repeat_interleave(rep, 1) for x in (k, v, kh, vh))
    slot = torch.arange(T)
    sealed_at = slot // GROUP * GROUP + GROUP - 1
    out = torch.empty_like(q)
    for t0 in range(0, T, 512):
        t1 = min(T, t0 + 512)
        p = torch.arange(t0, t1)[:, None]
        sealed = sealed_at[None, :t1] <= p
        qs = q[:, :, t0:t1] * D**-0.5
        scores = torch.where(sealed, qs @ kh[:, :, :t1].transpose(-1, -2), qs @ k[:, :, :t1].transpose(-1, -2))
        w = scores.masked_fill(slot[None, :t1] > p, float("-inf")).softmax(-1)
        out[:, :, t0:t1] = torch.where(sealed, w, 0.0) @ vh[:, :, :t1] + torch.where(sealed, 0.0, w) @ v[:, :, :t1]
    return out


def patched_forward(variant: str, rot: torch.Tensor):
    parts = variant.split("+")

    def forward(self, x, cos, sin, layer_cache, step):
        B, T, _ = x.shape
        D = self.cfg.head_dim
        q = self.q_proj(x).view(B, T, -1, D)
        k = self.k_proj(x).view(B, T, -1, D)
        v = self.v_proj(x).view(B, T, -1, D).transpose(1, 2)
        if self.cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        c, s = cos.unsqueeze(2), sin.unsqueeze(2)
        q = apply_rope(q, c, s).transpose(1, 2)
        k_pre, k = k.transpose(1, 2), apply_rope(k, c, s).transpose(1, 2)
        opts = set()
        for part in parts:
            if part.startswith("L") and "=" in part:
                layer, opt = part[1:].split("=")
                if int(layer) == self.layer_index:
                    opts.add(opt)
            else:
                opts.add(part)
        kh, vh = read_back(opts, k, k_pre, v, cos.unsqueeze(1), sin.unsqueeze(1), rot)
        return self.o_proj(attend(q, k, v, kh, vh).transpose(1, 2).reshape(B, T, -1))

    return forward


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--variants", default=DEFAULT)
    p.add_argument("--seed", type=int, default=0, help="the Hadamard matrix's signs")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--text", default=None,
                   help="one packaged held-out text by name (austen__emma, kjv__luke, ...; default: all of "
                        "them in one stream, whose first tokens are austen__emma's)")
    args = p.parse_args()
    if args.tokens % GROUP:
        p.error(f"--tokens must be a multiple of {GROUP}")
    set_threads(args.threads)
    tokenizer, model = load_tokenizer(None), load(None)
    if args.text is None:
        ids = read_texts(None, tokenizer)[None, : args.tokens]
    else:
        import tempfile
        from pathlib import Path

        from kvcache.eval.tasks import DEFAULT_TEXTS

        with tempfile.TemporaryDirectory() as one:
            (Path(one) / f"{args.text}.txt").write_text((DEFAULT_TEXTS / f"{args.text}.txt").read_text())
            ids = read_texts(one, tokenizer)[None, : args.tokens]
    attention = [m for m in model.modules() if isinstance(m, model_module.Attention)]
    for i, m in enumerate(attention):
        m.layer_index = i
    rot = hadamard(attention[0].cfg.head_dim, args.seed)
    report = {"tokens": ids.shape[1], "text": args.text or "all", "seed": args.seed, "threads": args.threads,
              "variants": {}}
    original = model_module.Attention.forward
    with torch.inference_mode():
        ref = F.log_softmax(model(ids)[0, :-1].float(), -1)
        for variant in args.variants.split(","):
            model_module.Attention.forward = patched_forward(variant, rot)
            try:
                logp = F.log_softmax(model(ids)[0, :-1].float(), -1)
            finally:
                model_module.Attention.forward = original
            report["variants"][variant] = {
                "top1_agreement": round((logp.argmax(-1) == ref.argmax(-1)).float().mean().item(), 5),
                "kl": round(max(0.0, (ref.exp() * (ref - logp)).sum(-1).mean().item()), 5),
                "perplexity": round(math.exp(-logp.gather(1, ids[0, 1:, None]).mean().item()), 2),
            }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
