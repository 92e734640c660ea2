"""The decoder's queries come in groups: `QueryGroup` says of one kind of query how many there are, whether they run
only in training, where their contents and positions come from, how they are assigned to targets, how their losses
are named and weighed, and which other groups their self-attention sees. `query_groups` reads a config's model (and
loss) section into them; the model, the transformer, the criterion, the trainer, the memory plan and the exports read
the groups, not the flags that made them.

- `one2one`: the detector's queries (the authors'), matched one-to-one (Hungarian); contents and positions learned,
  or from the encoder's proposals (two-stage), or contents learned and positions from the proposals (mixed selection:
  H-Deformable-DETR's and DINO's).
- `one2many`: H-Deformable-DETR's hybrid branch, in training only: more queries of the same kind, matched to the
  targets repeated k times, weighed by lambda, seeing no other group.
- `denoising`: DINO's contrastive denoising, in training only: noised copies of the targets (models/denoising.py),
  each assigned to the target it copies, seeing the one-to-one queries (which do not see them) and, among
  themselves, only their own copy of the targets (a mask the targets decide, of fixed shape)."""

import itertools
from dataclasses import dataclass

from ..config import LossConfig, ModelConfig

LEARNED, PROPOSALS, TARGETS = "learned", "proposals", "targets"  # where contents and positions come from
HUNGARIAN, REPEATED, KNOWN = "hungarian", "repeated", "known"  # how queries are assigned to targets


@dataclass(frozen=True)
class QueryGroup:
    name: str  # the key of its predictions in the model's outputs (the first group's are the outputs themselves)
    count: int  # its queries
    training_only: bool  # run in training only (the detector's own run always)
    contents: str  # LEARNED | PROPOSALS | TARGETS
    positions: str  # LEARNED | PROPOSALS | TARGETS
    assignment: str  # HUNGARIAN | REPEATED (the targets repeated `repeats` times) | KNOWN (the target each copies)
    repeats: int = 1
    loss_suffix: str = ""  # after each loss name and layer index: loss_ce_0_one2many, loss_ce_dn
    loss_weight: float = 1.0  # its losses' factor (H-Deformable-DETR's lambda)
    sees: tuple[str, ...] = ()  # the other groups its self-attention sees (it sees itself)


def query_groups(m: ModelConfig, loss: LossConfig | None = None) -> tuple[QueryGroup, ...]:
    """The groups of the model section `m`, the detector's first; `loss` gives the assignments' repeats and the
    losses' weights (the model itself needs neither)."""
    loss = loss or LossConfig()
    positions = PROPOSALS if m.two_stage else LEARNED
    contents = PROPOSALS if m.two_stage and not m.mixed_selection else LEARNED
    groups = [QueryGroup("one2one", m.num_queries, False, contents, positions, HUNGARIAN)]
    if m.num_queries_one2many:
        groups.append(
            QueryGroup(
                "one2many",
                m.num_queries_one2many,
                True,
                contents,
                positions,
                REPEATED,
                repeats=loss.k_one2many,
                loss_suffix="_one2many",
                loss_weight=loss.lambda_one2many,
            )
        )
    if m.dn_number:
        groups.append(
            QueryGroup("denoising", 2 * m.dn_number, True, TARGETS, TARGETS, KNOWN, 1, "_dn", 1.0, ("one2one",))
        )
    return tuple(groups)


def running(groups, training: bool, denoising: bool = False) -> tuple[QueryGroup, ...]:
    """The groups a forward runs: the detector's always, the training-only ones in training; the denoising group
    only where the targets' noised copies are given (`denoising`)."""
    return tuple(
        g for g in groups if (training or not g.training_only) and (g.contents != TARGETS or (training and denoising))
    )


def from_source(groups, source: str, part: str = "positions") -> int:
    """How many queries of `groups` take their `part` (positions or contents) from `source`."""
    return sum(g.count for g in groups if getattr(g, part) == source)


def spans(groups) -> dict[str, slice]:
    """Each group's queries in the decoder's order (the groups' order): {name: slice}."""
    bounds = list(itertools.accumulate((g.count for g in groups), initial=0))
    return {g.name: slice(start, end) for g, start, end in zip(groups, bounds[:-1], bounds[1:], strict=True)}


def attention_plan(groups, masks: dict | None = None):
    """The decoder's self-attention over `groups` (running): None where one group attends to itself alone (a
    plain self-attention), else [(its queries, the keys it sees (slices, its own first), an additive mask over
    those keys or None)] per group. `masks`: {group name: (its count, the keys' count) additive mask}, the
    denoising group's (DenoisingQueries.attention_mask)."""
    if len(groups) == 1:
        return None
    at = spans(groups)
    masks = masks or {}
    return [(at[g.name], (at[g.name], *(at[name] for name in g.sees)), masks.get(g.name)) for g in groups]
