"""The one detection result: what capture + detection found in a model."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Detection:
    """What capture + detection found: the sites, the near misses, how the graph was captured."""

    sites: list = field(default_factory=list)  # list[AttentionSite], in layer order
    near_misses: list = field(default_factory=list)  # list[NearMiss]
    capture: str = ""  # e.g. "torch.export", "export+hf", "hf"
    notes: list = field(default_factory=list)
    counts: dict = field(default_factory=dict)
