// An elementwise update rule written in jax.numpy, run as a tile program: the rule's jaxpr,
// compiled by jax_mlpo/optimizers/rule_program.py into a short list of float32 operations over
// registers of kRuleTile elements, runs over a segment one tile at a time, every operation a
// vectorized loop over a tile that stays in the L1 cache. The whole rule is one pass over the
// state (each array read and written once), where XLA:CPU makes one loop per output and
// recomputes what it needs (docs/extending.md has the measurements).
//
// A program has three parts, each a list of instructions of kRuleWords int32 words
// {op, dst, a, b, c}:
//  - the prologue, over scalar registers: the step's scalars (the hyper-parameters, the literals)
//    and what the rule computes from them alone, once per call;
//  - the setup, kRuleBroadcast instructions only {op, tile register, scalar register}: each
//    scalar a tile operation reads, broadcast into a tile register once per thread;
//  - the body, per tile: loads of the inputs into registers, the operations, stores of the
//    outputs (all stores after all loads, so an output may share an input's memory).
// Registers from tile_regs on are the arrays' own tiles, in the arrays' order: an operation
// that writes one computes a float32 output in place (every load then precedes it).
// Every value is a float32: a bfloat16 is loaded widened and rounded with kRuleRoundBf16 where
// the rule converts to it, a boolean is 0 or 1. MulAdd (a * b + c), MulSub (a * b - c) and
// NegMulAdd (c - a * b) round once, as XLA:CPU's contraction of a product into its sum does.
#ifndef JAX_MLPO_FFI_RULE_H_
#define JAX_MLPO_FFI_RULE_H_

#include <cstddef>
#include <cstdint>

namespace jax_mlpo {

// X(name, operands): every operation, in code order (rule_program.py reads the names).
#define JAX_MLPO_RULE_OPS(X)                                                                \
  X(LoadF32, 1) X(LoadBf16, 1) X(StoreF32, 1) X(StoreBf16, 1) X(Broadcast, 1) X(Copy, 1)    \
  X(Neg, 1) X(Abs, 1) X(Sign, 1) X(Sqrt, 1) X(Rsqrt, 1) X(Exp, 1) X(Exp2, 1) X(Log, 1)      \
  X(Log1p, 1) X(Expm1, 1) X(Tanh, 1) X(Logistic, 1) X(Sin, 1) X(Cos, 1) X(Floor, 1)         \
  X(Ceil, 1) X(RoundBf16, 1) X(Not, 1) X(IsFinite, 1) X(Add, 2) X(Sub, 2) X(Mul, 2)         \
  X(Div, 2) X(Max, 2) X(Min, 2) X(Pow, 2) X(Lt, 2) X(Le, 2) X(Gt, 2) X(Ge, 2) X(Eq, 2)      \
  X(Ne, 2) X(And, 2) X(Or, 2) X(Xor, 2) X(Select, 3) X(Clamp, 3) X(MulAdd, 3) X(MulSub, 3)     \
  X(NegMulAdd, 3)

enum RuleOp : int32_t {
#define JAX_MLPO_RULE_ENUM(name, operands) kRule##name,
  JAX_MLPO_RULE_OPS(JAX_MLPO_RULE_ENUM)
#undef JAX_MLPO_RULE_ENUM
  kRuleOpCount
};

constexpr size_t kRuleWords = 5;    // {op, dst, a, b, c}
constexpr size_t kRuleTile = 256;   // elements per register: 2 KiB, a program's live ones in L1

// One call: the program, its scalar registers' values before the prologue, the arrays the loads
// and stores name by index (float32, or bfloat16 as uint16 bits, as the load or store says).
struct RuleArgs {
  const int32_t* prologue;
  size_t prologue_len;  // instructions
  const int32_t* setup;
  size_t setup_len;
  const int32_t* body;
  size_t body_len;
  const float* scalars;  // the scalar registers' initial values
  size_t scalar_regs;
  size_t tile_regs;
  void* const* arrays;
  size_t n_arrays;
  const bool* viewable;  // per array: a float32 load may read it in place (nothing writes it)
};

using RuleRangeFn = void (*)(const RuleArgs&, size_t begin, size_t end);

// The name of each operation, indexed by RuleOp.
extern const char* const kRuleOpNames[kRuleOpCount];

}  // namespace jax_mlpo

#endif  // JAX_MLPO_FFI_RULE_H_
