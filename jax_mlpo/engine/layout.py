"""Params pytree ↔ flat subgroups.

The leaves of the params pytree are laid end to end (in ``jax.tree`` order) in one flat index
space, which is cut into subgroups of ``subgroup_size`` elements; a leaf may span subgroups.
Each subgroup is a list of segments, a segment being the part of one leaf that falls in the
subgroup, so it has one dtype and one weight-decay flag.

A subgroup's blob is ``[p | m | v]`` when it holds any bfloat16 leaf (``p`` is the fp32 master
copy) and ``[m | v]`` otherwise (fp32 params are the master copy themselves); an optimizer with
one moment (Lion) has ``[p | m]`` or ``[m]``. An engine that keeps no master (Muon's momentum
pass: the master of its bfloat16 params is another engine's) has ``[m]`` for every leaf, and an
engine with no moments (Muon's master pass) ``[p]``. The moments are named by the optimizer
(:mod:`jax_mlpo.optimizers`: ``"mu"``, ``"nu"``), and those names are the arrays of
``state_dict`` and of checkpoints. The blob is a float32 buffer; each moment is float32,
bfloat16 or q8 (``mu_dtype``, ``nu_dtype``), padded to whole float32 words, so a bfloat16 moment
halves its part of every read and write and a q8 one (:mod:`jax_mlpo.engine.quantize`: a byte per
element) quarters it. A q8 moment's block scales follow the codes: ``[p | m | v | m scales | v
scales]``, one scale per 256 elements of each segment (blocks start at segment starts, where the
kernel's calls start).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from jax_mlpo.engine.quantize import BLOCK, Q8, Quantized, moment_dtype, num_blocks
from jax_mlpo.native.kernels import q8_decode, q8_encode
from jax_mlpo.types import BF16, F32

SUPPORTED_PARAM_DTYPES = (F32, BF16)
SUPPORTED_MOMENT_DTYPES = (F32, BF16, Q8)

Moment = np.ndarray | Quantized  # a moment's view: float32/bfloat16 elements, or q8 codes
ADAMW_MOMENTS = ("mu", "nu")


def is_signed(moment: str) -> bool:
    """Whether a moment takes negative values (its q8 code has a sign bit): all but ``nu``."""
    return moment != "nu"


def _words(n: int, dtype: np.dtype) -> int:
    """float32 words that hold ``n`` elements of ``dtype``."""
    return -(-n * dtype.itemsize // 4)


def state_bytes_per_param(has_master: bool, moment_dtypes: Sequence[Any]) -> float:
    """Bytes of state per parameter: the fp32 master (bfloat16 params only), m and v at their
    widths (a q8 moment: 1 + 4/256 with its scales; a subgroup pads each part to whole float32
    words, and a q8 segment's last block to a whole scale)."""
    moments = [moment_dtype(d) for d in moment_dtypes]
    return (4 if has_master else 0) + sum(1 + 4 / BLOCK if d == Q8 else d.itemsize for d in moments)


@dataclasses.dataclass(frozen=True)
class Segment:
    """The part of one leaf inside one subgroup."""

    leaf: int  # index of the leaf in tree order
    leaf_start: int  # first element in the flattened leaf
    start: int  # first element in the subgroup
    size: int
    decay: bool  # whether weight decay applies (the mask)
    master: bool  # the leaf is bfloat16, so p holds its fp32 master copy

    @property
    def span(self) -> slice:
        """Where the segment is in its subgroup."""
        return slice(self.start, self.start + self.size)

    @property
    def leaf_span(self) -> slice:
        """Where the segment is in its flattened leaf."""
        return slice(self.leaf_start, self.leaf_start + self.size)


@dataclasses.dataclass(frozen=True)
class Subgroup:
    index: int
    size: int
    segments: tuple[Segment, ...]
    has_master: bool
    moment_dtypes: tuple[np.dtype, ...] = (F32, F32)  # each moment's, in the blob's order
    moment_names: tuple[str, ...] = ADAMW_MOMENTS  # the optimizer's names for them

    @functools.cached_property
    def block_starts(self) -> dict[int, int]:
        """Each segment's first q8 scale, by the segment's start; the scales in all at ``size``."""
        starts, at = {}, 0
        for seg in self.segments:
            starts[seg.start] = at
            at += num_blocks(seg.size)
        starts[self.size] = at
        return starts

    @property
    def state_elems(self) -> int:
        """float32 words of this subgroup's blob: p (if any), m and v (and q8 scales)."""
        scales = sum(self.block_starts[self.size] for d in self.moment_dtypes if d == Q8)
        words = sum(_words(self.size, d) for d in self.moment_dtypes)
        return (self.size if self.has_master else 0) + words + scales

    @property
    def state_bytes(self) -> int:
        return 4 * self.state_elems

    def split(self, blob: np.ndarray) -> tuple[Any, ...]:
        """Views of this subgroup's blob: the fp32 master p (or None), then each moment (arrays
        of their dtypes, or :class:`~jax_mlpo.engine.quantize.Quantized` codes and scales)."""
        n, blocks = self.size, self.block_starts[self.size]
        at = n if self.has_master else 0
        p = blob[:n] if self.has_master else None
        views = []
        for dt in self.moment_dtypes:
            views.append(blob[at : at + _words(n, dt)].view(dt)[:n])
            at += _words(n, dt)
        for k, dt in enumerate(self.moment_dtypes):
            if dt == Q8:
                views[k] = Quantized(views[k], blob[at : at + blocks])
                at += blocks
        return (p, *views)

    def segment(self, moment: Moment, seg: Segment) -> Moment:
        """The part of a moment view (:meth:`split`) that holds segment ``seg``."""
        if isinstance(moment, Quantized):
            first = self.block_starts[seg.start]
            end = first + num_blocks(seg.size)
            return Quantized(moment.codes[seg.span], moment.scales[first:end])
        return moment[seg.span]


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where every parameter element lives in the subgroups."""

    treedef: Any
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[np.dtype, ...]
    subgroups: tuple[Subgroup, ...]
    subgroup_size: int
    moment_dtypes: tuple[np.dtype, ...] = (F32, F32)  # each moment's
    moment_names: tuple[str, ...] = ADAMW_MOMENTS  # the optimizer's names for them
    keeps_master: bool = True  # the fp32 master of bfloat16 leaves is in this state

    def has_master(self, leaf: int) -> bool:
        """Whether this state holds leaf ``leaf``'s fp32 master (a bfloat16 leaf's, if kept)."""
        return self.keeps_master and self.dtypes[leaf] == BF16

    @property
    def num_params(self) -> int:
        return sum(sg.size for sg in self.subgroups)

    @property
    def max_subgroup_elems(self) -> int:
        return max((sg.size for sg in self.subgroups), default=0)

    @property
    def max_state_elems(self) -> int:
        return max((sg.state_elems for sg in self.subgroups), default=0)

    @property
    def state_bytes(self) -> int:
        return sum(sg.state_bytes for sg in self.subgroups)

    def check_leaves(
        self, grads: Sequence[np.ndarray], params: Sequence[np.ndarray],
        updates: Sequence[np.ndarray],
    ) -> None:  # fmt: skip
        """Checks an update's flat leaves (gradients, params, updates) against the layout.

        Raises:
          ValueError: naming the leaf whose count, size or dtype is wrong.
        """
        shapes = self.shapes
        if not len(grads) == len(params) == len(updates) == len(shapes):
            raise ValueError(
                f"update got {len(grads)} gradient, {len(params)} param and {len(updates)} "
                f"update leaves; the optimizer was initialised with {len(shapes)}"
            )
        for i, (g, p, u) in enumerate(zip(grads, params, updates, strict=True)):
            size = int(np.prod(shapes[i], dtype=np.int64))
            if not g.size == p.size == u.size == size:
                raise ValueError(
                    f"leaf {i}: expected {size} elements, got {g.size}/{p.size}/{u.size} "
                    "(gradient/param/update)"
                )
            if u.dtype != F32 and not (u.dtype == BF16 == self.dtypes[i]):
                raise ValueError(
                    f"leaf {i}: the update must be float32 (or bfloat16 for bfloat16 params), "
                    f"got {u.dtype}"
                )
            if g.dtype not in (F32, BF16):
                raise ValueError(f"leaf {i}: gradients must be float32 or bfloat16, got {g.dtype}")
            if p.dtype != self.dtypes[i]:
                raise ValueError(
                    f"leaf {i}: param dtype {p.dtype} differs from {self.dtypes[i]} at init"
                )


def resolve_mask(mask: Any, params: Any) -> list[bool]:
    """Per-leaf weight-decay flags from an optax-style mask (pytree, prefix or callable).

    Raises:
      ValueError: if the mask's structure does not match params or its leaves are not bools.
    """
    leaves = jax.tree.leaves(params)
    if mask is None:
        return [True] * len(leaves)
    if callable(mask):
        mask = mask(params)
    try:
        flags = jax.tree_util.tree_structure(params).flatten_up_to(
            jax.tree.map(lambda m, p: m, mask, params, is_leaf=lambda x: isinstance(x, bool))
        )
    except (ValueError, TypeError) as e:
        raise ValueError(
            "mask must be a pytree of bools with the structure of params (or a prefix of it), "
            f"or a callable returning one: {e}"
        ) from e
    out = []
    for flag in flags:
        if isinstance(flag, bool | np.bool_):
            out.append(bool(flag))
        else:
            raise ValueError(
                f"mask leaves must be Python bools fixed at init, got {type(flag).__name__}; "
                "jax_mlpo lays out weight decay per parameter when the optimizer is created"
            )
    return out


def check_moment_dtypes(
    moment_dtypes: Sequence[Any], names: Sequence[str] = ADAMW_MOMENTS
) -> tuple[np.dtype, ...]:
    """Moment dtypes (``mu_dtype``, ``nu_dtype``) as a layout keeps them (numpy dtypes; q8 is
    :data:`jax_mlpo.engine.quantize.Q8`).

    Raises:
      ValueError: for a dtype other than float32, bfloat16 and "q8".
    """
    moments = []
    for name, spec in zip((f"{n}_dtype" for n in names), moment_dtypes, strict=True):
        try:
            dt = moment_dtype(spec)
        except TypeError:
            dt = None
        # np.uint8 itself is refused: it names q8 inside a layout, but a user's uint8 would
        # mean an integer moment
        if dt not in SUPPORTED_MOMENT_DTYPES or (dt == Q8 and spec is not Q8 and spec != "q8"):
            label = spec if dt is None or isinstance(spec, str) else dt.name
            raise ValueError(
                f"{name}={label}: jax_mlpo stores moments in float32, bfloat16 (jnp.bfloat16) "
                'or "q8" (8-bit blockwise)'
            )
        moments.append(dt)
    return tuple(moments)


def stacked_runs(params: Any) -> list[range]:
    """The runs of leaves (indices in ``jax.tree`` order) that look like stacked layers: all the
    leaves of one subtree (not the root, two or more) with the same leading dimension ``L``,
    2 <= ``L``, smaller than each of their other dimensions (a ``[layers, ...]`` stack, as
    ``nnx.vmap`` and ``nnx.scan`` make them; a layer's own ``[d, d]`` kernels do not qualify).
    The largest such subtrees are taken."""
    paths = [path for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    shapes = [tuple(np.shape(x)) for x in jax.tree.leaves(params)]
    runs: list[range] = []
    k = 0
    while k < len(paths):
        for depth in range(1, len(paths[k])):
            prefix = paths[k][:depth]
            if k and paths[k - 1][:depth] == prefix:
                continue  # leaf k is not the first of this subtree
            end = k
            while end < len(paths) and paths[end][:depth] == prefix:
                end += 1
            if end - k >= 2 and _stacked([shapes[i] for i in range(k, end)]):
                runs.append(range(k, end))
                k = end
                break
        else:
            k += 1
    return runs


def _stacked(shapes: list[tuple[int, ...]]) -> bool:
    rows = {s[0] if len(s) >= 2 else 0 for s in shapes}
    return len(rows) == 1 and 2 <= rows.pop() < min(min(s[1:]) for s in shapes)


def _pieces(shapes: Sequence[tuple[int, ...]], runs: Sequence[range]
            ) -> list[tuple[int, int, int]]:  # fmt: skip
    """``(leaf, first element, elements)`` in the order the subgroups hold them: each leaf whole,
    but a run of stacked leaves row by row (row 0 of each, then row 1...), so that the
    subgroups follow the layers a scan runs through."""
    first = {run.start: run for run in runs}
    pieces, k = [], 0
    while k < len(shapes):
        if k in first:
            run = first[k]
            for row in range(shapes[k][0]):
                for i in run:
                    n = int(np.prod(shapes[i][1:], dtype=np.int64))
                    pieces.append((i, row * n, n))
            k = run.stop
            continue
        pieces.append((k, 0, int(np.prod(shapes[k], dtype=np.int64))))
        k += 1
    return pieces


def build_layout(
    params: Any, subgroup_size: int, decay_flags: Sequence[bool] | None = None,
    moment_dtypes: Sequence[Any] = (F32, F32), moment_names: Sequence[str] = ADAMW_MOMENTS,
    keeps_master: bool = True, by_row: bool = False,
) -> Layout:  # fmt: skip
    """Cuts the params pytree into subgroups.

    Args:
      params: a pytree of arrays or ``jax.ShapeDtypeStruct`` (only shapes and dtypes are read,
        so this works on tracers too).
      subgroup_size: elements per subgroup.
      decay_flags: per-leaf weight-decay flags (default: all True).
      moment_dtypes: the dtypes the moments are stored in (float32, bfloat16 or "q8").
      moment_names: the optimizer's names of the moments (:mod:`jax_mlpo.optimizers`).
      keeps_master: whether the state holds the fp32 master of bfloat16 leaves.
      by_row: lay out the leaves that look like stacked layers (:func:`stacked_runs`) row by
        row, so that a subgroup holds whole layers of the stack, not a part of each leaf: an
        overlapped step updates them layer by layer inside the scan
        (:mod:`jax_mlpo.engine.row_stream`).

    Returns:
      The layout.

    Raises:
      ValueError: for a parameter dtype other than float32 or bfloat16, or a moment dtype
        other than those.
    """
    moments = check_moment_dtypes(moment_dtypes, moment_names)
    names = tuple(moment_names)
    leaves, treedef = jax.tree.flatten(params)
    shapes = tuple(tuple(int(d) for d in np.shape(x)) for x in leaves)
    dtypes = tuple(np.dtype(x.dtype) for x in leaves)
    for i, dt in enumerate(dtypes):
        if dt not in SUPPORTED_PARAM_DTYPES:
            path = jax.tree_util.keystr(jax.tree_util.tree_flatten_with_path(params)[0][i][0])
            raise ValueError(
                f"param {path} has dtype {dt}; jax_mlpo's optimizers support float32 and bfloat16 "
                "params (cast the others, or keep them out of this optimizer with optax.masked)"
            )
    if decay_flags is None:
        decay_flags = [True] * len(leaves)

    subgroups: list[Subgroup] = []
    segments: list[Segment] = []
    filled = 0

    def close() -> None:
        nonlocal segments, filled
        if filled:
            has_master = any(s.master for s in segments)
            subgroups.append(
                Subgroup(len(subgroups), filled, tuple(segments), has_master, moments, names)
            )
        segments, filled = [], 0

    for i, start, size in _pieces(shapes, stacked_runs(params) if by_row else []):
        taken = 0
        while taken < size:
            n = min(size - taken, subgroup_size - filled)
            master = keeps_master and dtypes[i] == BF16
            segments.append(Segment(i, start + taken, filled, n, decay_flags[i], master))
            taken += n
            filled += n
            if filled == subgroup_size:
                close()
    close()
    return Layout(
        treedef, shapes, dtypes, tuple(subgroups), subgroup_size, moments, names, keeps_master
    )


def moment_f32(moment: Moment, *, signed: bool) -> np.ndarray:
    """A moment view's values in float32: a q8 one decoded (a new array), others as they are
    (numpy widens a bfloat16 view where it is assigned)."""
    if isinstance(moment, Quantized):
        return q8_decode(moment, signed=signed)
    return moment


def store_f32(moment: Moment, values: np.ndarray, *, signed: bool) -> None:
    """Writes float32 ``values`` into a moment view: rounded to nearest for bfloat16 and q8
    (a value a q8 code decoded to is stored as that code again)."""
    if isinstance(moment, Quantized):
        q8_encode(np.ascontiguousarray(values, F32), moment, signed=signed)
    else:
        moment[...] = values


def gather_state(sg: Subgroup, blob: np.ndarray, state: dict[str, list[np.ndarray | None]]) -> None:
    """Copies a subgroup's blob into per-leaf arrays, one list per moment name and ``"master"``
    (converting to float32)."""
    p, *moments = sg.split(blob)
    for seg in sg.segments:
        for name, moment in zip(sg.moment_names, moments, strict=True):
            values = moment_f32(sg.segment(moment, seg), signed=is_signed(name))
            state[name][seg.leaf].reshape(-1)[seg.leaf_span] = values
        if seg.master:
            state["master"][seg.leaf].reshape(-1)[seg.leaf_span] = p[seg.span]


def scatter_state(
    sg: Subgroup, state: dict[str, list[np.ndarray | None]], blob: np.ndarray
) -> None:
    """Fills a subgroup's blob from per-leaf arrays, one list per moment name and ``"master"``.

    Raises:
      ValueError: if a bfloat16 leaf has no master copy.
    """
    p, *moments = sg.split(blob)
    for seg in sg.segments:
        for name, moment in zip(sg.moment_names, moments, strict=True):
            values = np.asarray(state[name][seg.leaf], F32).reshape(-1)[seg.leaf_span]
            store_f32(sg.segment(moment, seg), values, signed=is_signed(name))
        if seg.master:
            master = state["master"][seg.leaf]
            if master is None:
                raise ValueError(f"leaf {seg.leaf} is bfloat16 but has no master copy")
            p[seg.span] = np.asarray(master, F32).reshape(-1)[seg.leaf_span]
