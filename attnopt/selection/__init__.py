"""keep:recall: which KV heads (or layers) stay exact softmax, chosen by measuring the model's own
retrieval under a quality budget (`attnopt.compile` runs it for rules that ask `+keep:recall`).

    probing.py    the probes built with the model's tokenizer, and what a measurement reads
    selector.py   exact attention switched per KV head on the accepted all-heads modules
    search.py     the greedy search and the budget
    store.py      the on-disk cache of measurements
    select.py     the compile step: signals, search, the chosen per-head sites built and verified
"""

from __future__ import annotations

from attnopt.selection.probing import Quality
from attnopt.selection.search import Budget
from attnopt.selection.select import HeadSelection, Selected, select_exact_heads

__all__ = ["select_exact_heads", "HeadSelection", "Selected", "Budget", "Quality"]
