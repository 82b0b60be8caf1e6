"""Evaluation as the field runs it: RULER's tasks generated offline, user datasets, scoring, and
sweeps over (policy, ratio, task, length) cells that survive interruption.

    sample.py    one example (context, question, answer prefix, answers) and its token ids
    haystack.py  essay text, noise sentences and word lists the tasks are built from
    ruler.py     RULER's 13 tasks, sized to a target length by binary search
    dataset.py   user datasets (JSON lines: context, question, answers, ...)
    scoring.py   string_match_all / string_match_part (RULER), exact_match, f1
    cell.py      one cell of a sweep, run by a pure function (what a Ray task would wrap)
    sweep.py     the driver: lists cells, skips finished ones, writes each result atomically
    leaderboard.py  per-task and average scores, the markdown table
    command.py   what ``kvcache eval`` does once its flags are parsed
"""
