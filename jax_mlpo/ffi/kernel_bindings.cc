// Python bindings of the host kernels (kernels.cc's drivers): fused AdamW, Lion, Muon's two
// passes and the q8 code, on numpy arrays, with the GIL released while they run.
//
// Arrays arrive as typed nb::ndarray views, never copied (noconvert). A bfloat16 array crosses
// as its uint16 bits (numpy exports no bfloat16 through DLPack or the buffer protocol), so the
// element type says what an array holds: float32, bfloat16 bits (uint16), or q8 codes (uint8).
// jax_mlpo.native checks dtypes, sizes and writability first with its own messages; the checks
// here keep a wrong call from reaching the loops. The scalars are a bound struct per kernel,
// prepared in Python exactly as the numpy reference computes them.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

#include "kernels.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace jax_mlpo {
namespace {

using In = nb::ndarray<nb::ro, nb::c_contig, nb::device::cpu>;
using Out = nb::ndarray<nb::c_contig, nb::device::cpu>;
using OptIn = std::optional<In>;
using OptOut = std::optional<Out>;

enum class Elem { kF32, kBf16, kQ8, kOther };

Elem KindOf(nb::dlpack::dtype d) {
  if (d == nb::dtype<float>()) return Elem::kF32;
  if (d == nb::dtype<uint16_t>()) return Elem::kBf16;
  if (d == nb::dtype<uint8_t>()) return Elem::kQ8;
  return Elem::kOther;
}

template <typename A>
Elem Kind(const A& a, const char* name, bool f32, bool bf16, bool q8 = false) {
  const Elem k = KindOf(a.dtype());
  if ((k == Elem::kF32 && f32) || (k == Elem::kBf16 && bf16) || (k == Elem::kQ8 && q8)) return k;
  throw nb::value_error((std::string(name) + " has an unexpected element type").c_str());
}

template <typename A>
void CheckSize(const A& a, size_t n, const char* name) {
  if (a.size() != n) throw nb::value_error((std::string(name) + " differs in size").c_str());
}

// The bytes of an argument, for the overlap check; written ones are checked against all others.
struct Range {
  const char* lo = nullptr;
  size_t bytes = 0;
  bool written = false;
};

template <typename A>
Range RangeOf(const A& a, bool written) {
  return {static_cast<const char*>(a.data()), a.nbytes(), written};
}
template <typename A>
Range RangeOf(const std::optional<A>& a, bool written) {
  return a ? RangeOf(*a, written) : Range{};
}

// Fails when a written range overlaps another, but for the pair (grad, update) when the update
// is computed in place over its gradient (the same buffer and width).
template <size_t N>
void CheckOverlap(const Range (&r)[N], int grad, int update, const char* kernel,
                  const char* moments) {
  const bool in_place = r[grad].lo != nullptr && r[grad].lo == r[update].lo &&
                        r[grad].bytes == r[update].bytes;
  for (size_t i = 0; i < N; ++i)
    for (size_t j = i + 1; j < N; ++j) {
      if (in_place && int(i) == grad && int(j) == update) continue;
      const Range &a = r[i], &b = r[j];
      if (!(a.written || b.written) || !a.lo || !b.lo || !a.bytes || !b.bytes) continue;
      if (a.lo < b.lo + b.bytes && b.lo < a.lo + a.bytes) {
        throw nb::value_error((std::string(kernel) + ": the written arrays (" + moments +
                               ", update_out, param_bf16_out, and param when update_param) " +
                               "must not overlap each other or the inputs")
                                  .c_str());
      }
    }
}

// The outputs every optimizer kernel shares: the update (float32, or bfloat16 as a difference to
// delta_base) and the new params in bfloat16. The caller has checked their writability.
template <typename Args>
void SetOutputs(Args& a, const OptOut& update_out, const OptIn& delta_base,
                const OptOut& param_bf16_out, size_t n, const char* kernel) {
  a.update_out = nullptr;
  a.update_bf16 = nullptr;
  a.delta_base = nullptr;
  a.param_bf16_out = nullptr;
  if (delta_base && !update_out) {
    throw nb::value_error(
        (std::string(kernel) + ": delta_base needs update_out (the update is new_param - "
                               "delta_base)").c_str());
  }
  if (update_out) {
    CheckSize(*update_out, n, "update_out");
    if (Kind(*update_out, "update_out", true, true) == Elem::kBf16) {
      if (!delta_base) {
        throw nb::value_error((std::string(kernel) + ": a bfloat16 update_out needs delta_base")
                                  .c_str());
      }
      a.update_bf16 = static_cast<uint16_t*>(update_out->data());
    } else {
      a.update_out = static_cast<float*>(update_out->data());
    }
  }
  if (delta_base) {
    CheckSize(*delta_base, n, "delta_base");
    Kind(*delta_base, "delta_base", false, true);
    a.delta_base = static_cast<const uint16_t*>(delta_base->data());
  }
  if (param_bf16_out) {
    CheckSize(*param_bf16_out, n, "param_bf16_out");
    Kind(*param_bf16_out, "param_bf16_out", false, true);
    a.param_bf16_out = static_cast<uint16_t*>(param_bf16_out->data());
  }
}

// The param array: only read, unless update_param (then jax_mlpo.native checked it is writable;
// it arrives read-only-typed because it may be read-only otherwise).
float* ParamData(const In& param, size_t n) {
  CheckSize(param, n, "param");
  Kind(param, "param", true, false);
  return const_cast<float*>(static_cast<const float*>(param.data()));
}

// A moment: float32, bfloat16 bits, or q8 codes with a float32 scale per kQ8Block elements.
struct Moment {
  void* data;
  float* scales = nullptr;
  bool bf16 = false, q8 = false;
  size_t bytes = 0;
};

Moment MomentOf(const Out& x, const OptOut& scales, size_t n, const char* name) {
  CheckSize(x, n, name);
  const Elem k = Kind(x, name, true, true, /*q8=*/true);
  Moment mo{x.data()};
  mo.bf16 = k == Elem::kBf16;
  mo.q8 = k == Elem::kQ8;
  if (mo.q8) {
    if (!scales || scales->size() != (n + kQ8Block - 1) / kQ8Block ||
        KindOf(scales->dtype()) != Elem::kF32) {
      throw nb::value_error((std::string(name) + ": q8 codes need float32 scales, one per " +
                             std::to_string(kQ8Block) + " elements").c_str());
    }
    mo.scales = static_cast<float*>(scales->data());
  }
  return mo;
}

void AdamWStep(Out m, Out v, In grad, In param, OptOut update_out, OptIn delta_base,
               OptOut param_bf16_out, OptOut m_scales, OptOut v_scales, const AdamWArgs& s,
               bool update_param, std::optional<uint32_t> seed) {
  const size_t n = m.size();
  const Moment mo = MomentOf(m, m_scales, n, "m"), vo = MomentOf(v, v_scales, n, "v");
  CheckSize(grad, n, "grad");
  AdamWArgs a = s;  // the scalars; the arrays and flags follow
  a.m = mo.data;
  a.v = vo.data;
  a.m_scale = mo.scales;
  a.v_scale = vo.scales;
  a.mu_bf16 = mo.bf16;
  a.nu_bf16 = vo.bf16;
  a.mu_q8 = mo.q8;
  a.nu_q8 = vo.q8;
  a.stochastic = seed.has_value();
  a.seed = seed.value_or(0);
  a.grad = grad.data();
  a.grad_bf16 = Kind(grad, "grad", true, true) == Elem::kBf16;
  a.param = ParamData(param, n);
  a.update_param = update_param;
  SetOutputs(a, update_out, delta_base, param_bf16_out, n, "adamw_step");
  if (a.nesterov && (a.mu_q8 || a.nu_q8)) {
    throw nb::value_error("adamw_step: nesterov is not supported with q8 moments");
  }
  const Range ranges[] = {
      RangeOf(m, true), RangeOf(v, true), RangeOf(grad, false), RangeOf(param, update_param),
      RangeOf(update_out, true), RangeOf(delta_base, false), RangeOf(param_bf16_out, true),
      RangeOf(m_scales, true), RangeOf(v_scales, true)};
  CheckOverlap(ranges, /*grad=*/2, /*update=*/4, "adamw_step", "m, v");
  if (n == 0) return;
  nb::gil_scoped_release release;
  AdamW(a, n);
}

void LionStep(Out m, In grad, In param, OptOut update_out, OptIn delta_base,
              OptOut param_bf16_out, const LionArgs& s, bool update_param) {
  const size_t n = m.size();
  CheckSize(grad, n, "grad");
  LionArgs a = s;
  a.m = m.data();
  a.mu_bf16 = Kind(m, "m", true, true) == Elem::kBf16;
  a.grad = grad.data();
  a.grad_bf16 = Kind(grad, "grad", true, true) == Elem::kBf16;
  a.param = ParamData(param, n);
  a.update_param = update_param;
  SetOutputs(a, update_out, delta_base, param_bf16_out, n, "lion_step");
  const Range ranges[] = {RangeOf(m, true),          RangeOf(grad, false),
                          RangeOf(param, update_param), RangeOf(update_out, true),
                          RangeOf(delta_base, false), RangeOf(param_bf16_out, true)};
  CheckOverlap(ranges, /*grad=*/1, /*update=*/3, "lion_step", "m");
  if (n == 0) return;
  nb::gil_scoped_release release;
  Lion(a, n);
}

void MomentumStep(Out m, In grad, Out out, const MomentumArgs& s) {
  const size_t n = m.size();
  CheckSize(grad, n, "grad");
  CheckSize(out, n, "out");
  Kind(out, "out", true, false);
  MomentumArgs a = s;
  a.m = m.data();
  a.mu_bf16 = Kind(m, "m", true, true) == Elem::kBf16;
  a.grad = grad.data();
  a.grad_bf16 = Kind(grad, "grad", true, true) == Elem::kBf16;
  a.out = static_cast<float*>(out.data());
  const Range ranges[] = {RangeOf(m, true), RangeOf(grad, false), RangeOf(out, true)};
  CheckOverlap(ranges, /*grad=*/1, /*update=*/2, "momentum_step", "m");
  if (n == 0) return;
  nb::gil_scoped_release release;
  Momentum(a, n);
}

void ApplyStep(In direction, In param, OptOut update_out, OptIn delta_base,
               OptOut param_bf16_out, const ApplyArgs& s, bool update_param) {
  const size_t n = direction.size();
  Kind(direction, "direction", true, false);
  ApplyArgs a = s;
  a.direction = static_cast<const float*>(direction.data());
  a.param = ParamData(param, n);
  a.update_param = update_param;
  SetOutputs(a, update_out, delta_base, param_bf16_out, n, "apply_step");
  const Range ranges[] = {RangeOf(direction, false), RangeOf(param, update_param),
                          RangeOf(update_out, true), RangeOf(delta_base, false),
                          RangeOf(param_bf16_out, true)};
  CheckOverlap(ranges, /*grad=*/0, /*update=*/2, "apply_step", "param");
  if (n == 0) return;
  nb::gil_scoped_release release;
  Apply(a, n);
}

using F32In = nb::ndarray<const float, nb::c_contig, nb::device::cpu>;
using F32Out = nb::ndarray<float, nb::c_contig, nb::device::cpu>;
using U8In = nb::ndarray<const uint8_t, nb::c_contig, nb::device::cpu>;
using U8Out = nb::ndarray<uint8_t, nb::c_contig, nb::device::cpu>;

void CheckQ8(size_t n, size_t codes, size_t scales) {
  if (codes != n || scales != (n + kQ8Block - 1) / kQ8Block) {
    throw nb::value_error("q8: codes and scales do not match the values' size");
  }
}

}  // namespace

void BindKernels(nb::module_& m) {
  // The scalars of each kernel, as float32 (the loops' type): prepared by jax_mlpo.native.
  nb::class_<AdamWArgs>(m, "AdamWScalars", "AdamW's float32 scalars and flags for one step.")
      .def(nb::init<>())
      .def_rw("c1", &AdamWArgs::c1, "f32(1 - b1)")
      .def_rw("b1", &AdamWArgs::b1, "b1 as applied to m (moment_decay)")
      .def_rw("c2", &AdamWArgs::c2, "f32(1 - b2)")
      .def_rw("b2", &AdamWArgs::b2)
      .def_rw("bc1", &AdamWArgs::bc1, "1 - b1^t")
      .def_rw("bc2", &AdamWArgs::bc2, "1 - b2^t")
      .def_rw("eps", &AdamWArgs::eps)
      .def_rw("weight_decay", &AdamWArgs::wd)
      .def_rw("neg_lr", &AdamWArgs::neg_lr, "-lr")
      .def_rw("grad_scale", &AdamWArgs::grad_scale, "1 when the gradient is not scaled")
      .def_rw("bc1_next", &AdamWArgs::bc1_next, "nesterov: 1 - b1^(t+1)")
      .def_rw("b1_blend", &AdamWArgs::b1_blend, "nesterov: f32(b1)")
      .def_rw("has_wd", &AdamWArgs::has_wd, "weight_decay != 0 (0 * p is no no-op for -0, inf)")
      .def_rw("nesterov", &AdamWArgs::nesterov);
  nb::class_<LionArgs>(m, "LionScalars", "Lion's float32 scalars for one step.")
      .def(nb::init<>())
      .def_rw("c1", &LionArgs::c1, "f32(1 - b1)")
      .def_rw("b1", &LionArgs::b1, "b1 as applied to m")
      .def_rw("c2", &LionArgs::c2, "f32(1 - b2)")
      .def_rw("b2", &LionArgs::b2, "b2 as applied to m")
      .def_rw("weight_decay", &LionArgs::wd)
      .def_rw("neg_lr", &LionArgs::neg_lr, "-lr")
      .def_rw("has_wd", &LionArgs::has_wd);
  nb::class_<MomentumArgs>(m, "MomentumScalars", "Muon's momentum pass: float32 scalars.")
      .def(nb::init<>())
      .def_rw("c", &MomentumArgs::c, "f32(1 - beta)")
      .def_rw("b", &MomentumArgs::b, "beta as applied to m")
      .def_rw("beta", &MomentumArgs::beta, "f32(beta), for the nesterov blend")
      .def_rw("bc", &MomentumArgs::bc, "1 - beta^t")
      .def_rw("bc_next", &MomentumArgs::bc_next, "1 - beta^(t+1)")
      .def_rw("nesterov", &MomentumArgs::nesterov);
  nb::class_<ApplyArgs>(m, "ApplyScalars", "Muon's master pass: float32 scalars.")
      .def(nb::init<>())
      .def_rw("weight_decay", &ApplyArgs::wd)
      .def_rw("neg_lr", &ApplyArgs::neg_lr, "-lr")
      .def_rw("has_wd", &ApplyArgs::has_wd);

  auto array = [](const char* name) { return nb::arg(name).noconvert(); };
  auto optional = [](const char* name) { return nb::arg(name).noconvert().none(); };
  m.def("adamw_step", &AdamWStep, array("m"), array("v"), array("grad"), array("param"),
        optional("update_out"), optional("delta_base"), optional("param_bf16_out"),
        optional("m_scales"), optional("v_scales"), "scalars"_a, nb::kw_only(),
        "update_param"_a, "seed"_a.none(),
        "One fused AdamW step in place; bfloat16 arrays as their uint16 bits, q8 moments as "
        "uint8 codes with their scales.");
  m.def("lion_step", &LionStep, array("m"), array("grad"), array("param"),
        optional("update_out"), optional("delta_base"), optional("param_bf16_out"),
        "scalars"_a, nb::kw_only(), "update_param"_a, "One fused Lion step in place.");
  m.def("momentum_step", &MomentumStep, array("m"), array("grad"), array("out"), "scalars"_a,
        "Muon's momentum pass in place.");
  m.def("apply_step", &ApplyStep, array("direction"), array("param"), optional("update_out"),
        optional("delta_base"), optional("param_bf16_out"), "scalars"_a, nb::kw_only(),
        "update_param"_a, "Muon's master pass in place.");
  m.def(
      "q8_encode",
      [](F32In x, U8Out codes, F32Out scales, bool is_signed, std::optional<uint32_t> seed) {
        CheckQ8(x.size(), codes.size(), scales.size());
        nb::gil_scoped_release release;
        if (x.size()) {
          Q8Encode(x.data(), x.size(), codes.data(), scales.data(), is_signed,
                   seed.has_value(), seed.value_or(0));
        }
      },
      array("x"), array("codes"), array("scales"), nb::kw_only(), "signed"_a, "seed"_a.none(),
      "Encodes float32 values into q8 codes and scales (stochastic rounding with a seed).");
  m.def(
      "q8_decode",
      [](U8In codes, F32In scales, F32Out out, bool is_signed) {
        CheckQ8(out.size(), codes.size(), scales.size());
        nb::gil_scoped_release release;
        if (out.size()) Q8Decode(codes.data(), scales.data(), out.size(), out.data(), is_signed);
      },
      array("codes"), array("scales"), array("out"), nb::kw_only(), "signed"_a,
      "Decodes q8 codes and scales into float32 values.");
}

}  // namespace jax_mlpo
