"""An elementwise rule in ``jax.numpy``, compiled into a tile program the host runs in one pass.

The rule is traced once into a jaxpr, and its equations become float32 operations over
registers of ``RULE_TILE`` elements (``jax_mlpo/ffi/rule.h``):

- what depends on the step's scalars alone (bias corrections, ``1 - b1``) is the prologue,
  computed once per call;
- a scalar that an operation on the arrays reads is broadcast into a register once per thread;
- per tile, the inputs are loaded (a bfloat16 widened), the operations run, and the outputs are
  stored (rounded to bfloat16 where the output is one), every store after every load.

Registers are reused once their value is dead, so a rule's live values stay in the L1 cache,
and each array is read and written once. An operation on bfloat16 values computes in float32
and rounds its result, as XLA:CPU does. A jaxpr with anything else (a reduction, an integer, a
shape other than the segment's) raises :class:`~jax_mlpo.UnsupportedRuleError`, naming the
equation; the runner then runs that rule through XLA (:mod:`jax_mlpo.optimizers.jax_rule`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_mlpo.errors import UnsupportedRuleError
from jax_mlpo.native.library import NATIVE
from jax_mlpo.types import BF16, F32

OP = {name: code for code, name in enumerate(NATIVE.RULE_OPS)}
_STORES = frozenset({OP["StoreF32"], OP["StoreBf16"]})
_LOADS = frozenset({OP["LoadF32"], OP["LoadBf16"]})
TRACE_LENGTH = 1024  # the traced segment's length: any, the program does not depend on it

_UNARY = {
    "neg": "Neg", "abs": "Abs", "sign": "Sign", "sqrt": "Sqrt", "rsqrt": "Rsqrt", "exp": "Exp",
    "exp2": "Exp2", "log": "Log", "log1p": "Log1p", "expm1": "Expm1", "tanh": "Tanh",
    "logistic": "Logistic", "sin": "Sin", "cos": "Cos", "floor": "Floor", "ceil": "Ceil",
    "is_finite": "IsFinite", "not": "Not",
}  # fmt: skip
_BINARY = {
    "add": "Add", "add_any": "Add", "sub": "Sub", "mul": "Mul", "div": "Div", "max": "Max",
    "min": "Min", "pow": "Pow", "lt": "Lt", "le": "Le", "gt": "Gt", "ge": "Ge", "eq": "Eq",
    "ne": "Ne", "and": "And", "or": "Or", "xor": "Xor",
}  # fmt: skip
_IDENTITY = {"copy", "copy_p", "reshape", "squeeze", "expand_dims", "broadcast_in_dim"}
_FLOATS = (np.dtype(F32), np.dtype(BF16))


@dataclass(frozen=True)
class _Value:
    """A jaxpr value: a scalar register, or a tile value (virtual until allocated)."""

    scalar: bool
    index: int


class _Builder:
    """Walks a jaxpr into the three parts of a tile program."""

    def __init__(self, n_scalars: int) -> None:
        self.scalar_init: list[float] = [0.0] * n_scalars
        self.prologue: list[list[int]] = []
        self.body: list[list[int]] = []  # over virtual tile values
        self.tiles = 0
        self.broadcasts: dict[int, int] = {}  # scalar register -> its virtual tile value
        self.constants: dict[bytes, int] = {}

    def constant(self, value: Any) -> _Value:
        key = np.float32(value).tobytes()
        if key not in self.constants:
            self.constants[key] = len(self.scalar_init)
            self.scalar_init.append(float(np.float32(value)))
        return _Value(True, self.constants[key])

    def _new_tile(self) -> int:
        self.tiles += 1
        return self.tiles - 1

    def tile_of(self, v: _Value) -> int:
        if not v.scalar:
            return v.index
        if v.index not in self.broadcasts:
            self.broadcasts[v.index] = self._new_tile()
        return self.broadcasts[v.index]

    def load(self, array: int, bf16: bool) -> _Value:
        dst = self._new_tile()
        self.body.append([OP["LoadBf16" if bf16 else "LoadF32"], dst, array, -1, -1])
        return _Value(False, dst)

    def op(self, name: str, *args: _Value, bf16: bool = False) -> _Value:
        operands = list(args) + [None] * (3 - len(args))
        if all(a.scalar for a in args):
            dst = len(self.scalar_init)
            self.scalar_init.append(0.0)
            regs = [-1 if a is None else a.index for a in operands]
            self.prologue.append([OP[name], dst, *regs])
            out = _Value(True, dst)
        else:
            dst = self._new_tile()
            regs = [-1 if a is None else self.tile_of(a) for a in operands]
            self.body.append([OP[name], dst, *regs])
            out = _Value(False, dst)
        return self.op("RoundBf16", out) if bf16 and name != "RoundBf16" else out

    def store(self, v: _Value, array: int, bf16: bool) -> None:
        self.body.append([OP["StoreBf16" if bf16 else "StoreF32"], array, self.tile_of(v), -1, -1])


_CALLS = {
    "pjit",
    "jit",
    "closed_call",
    "core_call",
    "custom_jvp_call",
    "custom_vjp_call",
    "custom_vjp_call_jaxpr",
    "remat",
    "checkpoint",
}


def _sub_jaxpr(eqn: Any) -> Any | None:
    """The jaxpr a call-like equation runs (jit, custom_jvp/vjp, closed_call, remat), or None."""
    if eqn.primitive.name not in _CALLS:
        return None
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        if eqn.params.get(key) is not None:
            return eqn.params[key]
    return None


def _check_aval(aval: Any, where: str) -> None:
    if np.dtype(aval.dtype) not in (*_FLOATS, np.dtype(bool)):
        raise UnsupportedRuleError(
            f"{where} has dtype {aval.dtype} (float32, bfloat16 and bool only)"
        )
    if aval.shape not in ((), (TRACE_LENGTH,)):
        raise UnsupportedRuleError(
            f"{where} has shape {aval.shape}, neither a scalar nor the segment's"
        )


def _integer_pow(b: _Builder, x: _Value, y: int, bf16: bool) -> _Value:
    """x ** y by repeated squaring, as jax lowers ``integer_pow``."""
    if y == 0:
        return b.constant(1.0)
    acc, base, n = None, x, abs(y)
    while n:
        if n & 1:
            acc = base if acc is None else b.op("Mul", acc, base, bf16=bf16)
        n >>= 1
        if n:
            base = b.op("Mul", base, base, bf16=bf16)
    return b.op("Div", b.constant(1.0), acc, bf16=bf16) if y < 0 else acc


def _equation(b: _Builder, eqn: Any, ins: list[_Value]) -> list[_Value]:
    name = eqn.primitive.name
    out_aval = eqn.outvars[0].aval
    bf16 = np.dtype(out_aval.dtype) == BF16
    if name in _IDENTITY:
        return [ins[0]]
    if name == "optimization_barrier":  # orders nothing here: its operands, as they are
        return list(ins)
    if name in _UNARY:
        return [b.op(_UNARY[name], ins[0], bf16=bf16)]
    if name == "div" and not ins[0].scalar and ins[1].scalar:
        # XLA:CPU multiplies by the reciprocal of a divisor that is the same for every element
        return [b.op("Mul", ins[0], b.op("Div", b.constant(1.0), ins[1]), bf16=bf16)]
    if name in _BINARY:
        return [b.op(_BINARY[name], ins[0], ins[1], bf16=bf16)]
    if name == "square":
        return [b.op("Mul", ins[0], ins[0], bf16=bf16)]
    if name == "integer_pow":
        return [_integer_pow(b, ins[0], int(eqn.params["y"]), bf16)]
    if name == "select_n" and len(ins) == 3:
        return [b.op("Select", *ins, bf16=bf16)]
    if name == "clamp":
        return [b.op("Clamp", *ins, bf16=bf16)]
    if name == "convert_element_type":
        src, dst = np.dtype(eqn.invars[0].aval.dtype), np.dtype(eqn.params["new_dtype"])
        if dst == np.dtype(bool) and src != np.dtype(bool):
            return [b.op("Ne", ins[0], b.constant(0.0))]
        return [b.op("RoundBf16", ins[0]) if dst == BF16 and src == F32 else ins[0]]
    if name == "reduce_precision":
        bits = (eqn.params["exponent_bits"], eqn.params["mantissa_bits"])
        if bits == (8, 7):
            return [b.op("RoundBf16", ins[0])]
        if bits == (8, 23):
            return [ins[0]]
    raise UnsupportedRuleError(f"the rule uses {name}, which a tile program does not run")


def _walk(b: _Builder, jaxpr: Any, consts: Sequence[Any], args: list[_Value]) -> list[_Value]:
    env: dict[Any, _Value] = {}

    def read(v: Any) -> _Value:
        if hasattr(v, "val"):  # a literal
            if np.ndim(v.val) != 0:
                raise UnsupportedRuleError("the rule holds an array constant")
            return b.constant(v.val)
        return env[v]

    for var, c in zip(jaxpr.constvars, consts, strict=True):
        if np.ndim(c) != 0:
            raise UnsupportedRuleError(
                "the rule closes over an array; pass it as a scalar or an input"
            )
        env[var] = b.constant(np.asarray(c))
    for var, a in zip(jaxpr.invars, args, strict=True):
        env[var] = a
    for eqn in jaxpr.eqns:
        for v in eqn.outvars:
            _check_aval(v.aval, f"{eqn.primitive.name}'s result")
        ins = [read(v) for v in eqn.invars]
        sub = _sub_jaxpr(eqn)
        if sub is not None:
            inner = sub.jaxpr if hasattr(sub, "jaxpr") else sub
            n_args = len(inner.invars)
            outs = _walk(b, inner, getattr(sub, "consts", ()), ins[len(ins) - n_args :])
        else:
            outs = _equation(b, eqn, ins)
        for var, value in zip(eqn.outvars, outs, strict=True):
            env[var] = value
    return [read(v) for v in jaxpr.outvars]


def _contract(code: list[list[int]], extra_uses: Sequence[int] = ()) -> None:
    """Fuses a product into the sum or difference that is its only use, in place, as LLVM does
    for XLA:CPU (the first operand's product first): ``x * y + z`` is one fma. The product's
    instruction stays, dead, for :func:`_allocate` to drop."""
    uses = Counter(extra_uses)
    producer = {}
    for ins in code:
        if ins[0] not in _LOADS:
            uses.update(_reads(ins))
        if ins[0] not in _STORES | _LOADS:
            producer[ins[1]] = ins

    def product(r: int) -> list[int] | None:
        p = producer.get(r)
        return p if p is not None and p[0] == OP["Mul"] and uses.get(r) == 1 else None

    for ins in code:
        if ins[0] not in (OP["Add"], OP["Sub"]):
            continue
        first, second = product(ins[2]), product(ins[3])
        if first is not None:
            fused = "MulAdd" if ins[0] == OP["Add"] else "MulSub"
            ins[:] = [OP[fused], ins[1], first[2], first[3], ins[3]]
        elif second is not None:
            fused = "MulAdd" if ins[0] == OP["Add"] else "NegMulAdd"
            ins[:] = [OP[fused], ins[1], second[2], second[3], ins[2]]


def _reads(ins: list[int]) -> list[int]:
    """The tile values an instruction reads."""
    if ins[0] in _LOADS:
        return []
    return [ins[2]] if ins[0] in _STORES else [r for r in ins[2:] if r >= 0]


def _schedule(body: list[list[int]]) -> tuple[list[list[int]], dict[int, int], set[int]]:
    """The body's instructions in the order they run, and where results go.

    Instructions whose result is never read are dropped. A value stored to a float32 output is
    computed straight into that output's memory (the store goes); the loads then come first, so
    that no input is read after an output over its memory is written. Otherwise each load comes
    just before its first use, for fewer live registers.

    Returns:
      The instructions, the values computed into an output (value -> array), the values read.
    """
    needed: set[int] = set()
    kept: list[list[int]] = []
    for ins in reversed(body):  # dead code: keep stores and what they need
        if ins[0] in _STORES or ins[1] in needed:
            kept.append(list(ins))
            needed.update(_reads(ins))
    kept.reverse()
    computed = {ins[1] for ins in kept if ins[0] not in _STORES | _LOADS}
    bound: dict[int, int] = {}
    for ins in kept:
        if ins[0] == OP["StoreF32"] and ins[2] in computed and ins[2] not in bound:
            bound[ins[2]] = ins[1]
    kept = [ins for ins in kept if not (ins[0] == OP["StoreF32"] and bound.get(ins[2]) == ins[1])]
    first = [ins for ins in kept if ins[0] in _LOADS]
    pending = {} if bound else {ins[1]: ins for ins in first}
    ordered = [] if pending else first
    for ins in kept:
        if ins[0] in _LOADS:
            continue
        ordered.extend(pending.pop(r) for r in _reads(ins) if r in pending)
        ordered.append(ins)
    return ordered, bound, needed


def _allocate(b: _Builder, body: list[list[int]]) -> tuple[np.ndarray, np.ndarray, int]:
    """Physical registers for the virtual tile values of :func:`_schedule`'s instructions.

    The broadcasts keep their registers; a value computed into an output has that array's
    register (numbered after the tile registers); the others are reused once dead, and an
    operation's result never takes one of its operands' registers.

    Returns:
      The setup, the body and the number of tile registers.
    """
    ordered, bound, needed = _schedule(body)
    last = {r: k for k, ins in enumerate(ordered) for r in _reads(ins)}
    broadcast = set(b.broadcasts.values())
    phys = {t: k for k, t in enumerate(t for t in b.broadcasts.values() if t in needed)}
    setup = [[OP["Broadcast"], phys[t], s, -1, -1] for s, t in b.broadcasts.items() if t in phys]
    free: list[int] = []
    count, out = len(phys), []
    for k, ins in enumerate(ordered):
        ins = list(ins)
        if ins[0] in _STORES:
            ins[2] = phys[ins[2]]
        else:
            if ins[0] not in _LOADS:
                ins[2:] = [phys[r] if r >= 0 else -1 for r in ins[2:]]
            if ins[1] in bound:
                phys[ins[1]] = -2 - bound[ins[1]]  # an output's: numbered at the end
            elif free:
                phys[ins[1]] = free.pop()
            else:
                phys[ins[1]], count = count, count + 1
            ins[1] = phys[ins[1]]
        for r in set(_reads(ordered[k])):
            if last[r] == k and phys[r] >= 0 and r not in broadcast:
                free.append(phys[r])
        out.append(ins)
    renumber = {-2 - a: count + a for a in bound.values()}
    for ins in out:  # registers, not the array index of a load or a store
        for j in (2,) if ins[0] in _STORES else (1,) if ins[0] in _LOADS else (1, 2, 3, 4):
            ins[j] = renumber.get(ins[j], ins[j])
    return np.array(setup, np.int32).reshape(-1, 5), np.array(out, np.int32).reshape(-1, 5), count


@dataclass(frozen=True)
class TileRule:
    """A compiled rule: run it with the step's scalars and the arrays (inputs, then outputs)."""

    program: Any  # jax_mlpo._native.TileProgram
    scalar_init: np.ndarray
    n_scalars: int
    tile_regs: int  # registers of RULE_TILE elements each thread keeps
    body_len: int  # instructions per tile

    def run(self, scalars: Sequence[float], arrays: Sequence[np.ndarray]) -> None:
        values = self.scalar_init.copy()
        values[: self.n_scalars] = scalars
        self.program.run(values, [a.view(np.uint16) if a.dtype == BF16 else a for a in arrays])


def compile_rule(
    fn: Callable[..., Sequence[jax.Array]], input_dtypes: Sequence[Any], n_scalars: int
) -> TileRule:
    """Compiles ``fn(*inputs, *scalars) -> outputs``, elementwise over the inputs.

    Args:
      fn: the rule, in ``jax.numpy``: the inputs are arrays of one length, the scalars float32.
      input_dtypes: each input's dtype (float32 or bfloat16).
      n_scalars: how many scalars follow the inputs.

    Returns:
      The :class:`TileRule`; its arrays are the inputs, then the outputs (float32 or
      bfloat16, as ``fn`` returns them; an output may be an input's own memory).

    Raises:
      UnsupportedRuleError: ``fn`` uses an operation, dtype or shape a tile program does not run.
    """
    specs = [jax.ShapeDtypeStruct((TRACE_LENGTH,), d) for d in input_dtypes]
    specs += [jax.ShapeDtypeStruct((), jnp.float32)] * n_scalars
    closed = jax.make_jaxpr(fn)(*specs)
    b = _Builder(n_scalars)
    for k, d in enumerate(input_dtypes):
        if np.dtype(d) not in _FLOATS:
            raise UnsupportedRuleError(f"input {k} is {np.dtype(d)} (float32 or bfloat16 only)")
    n_in = len(input_dtypes)
    loads = [b.load(k, np.dtype(d) == BF16) for k, d in enumerate(input_dtypes)]
    args = loads + [_Value(True, k) for k in range(n_scalars)]
    outs = _walk(b, closed.jaxpr, closed.consts, args)
    for k, (value, var) in enumerate(zip(outs, closed.jaxpr.outvars, strict=True)):
        dtype = np.dtype(var.aval.dtype)
        if dtype not in _FLOATS or var.aval.shape not in ((), (TRACE_LENGTH,)):
            raise UnsupportedRuleError(f"output {k} is {dtype}{list(var.aval.shape)}")
        b.store(value, n_in + k, dtype == BF16)
    _contract(b.prologue, extra_uses=list(b.broadcasts))
    _contract(b.body)
    setup, body, tile_regs = _allocate(b, b.body)
    prologue = np.array(b.prologue, np.int32).reshape(-1, 5)
    scalar_init = np.array(b.scalar_init, np.float32)
    program = NATIVE.TileProgram(prologue, setup, body, len(scalar_init), max(tile_regs, 1),
                                  n_in + len(outs))  # fmt: skip
    return TileRule(program, scalar_init, n_scalars, max(tile_regs, 1), len(body))
