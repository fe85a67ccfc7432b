// Python binding of the tile program (rule.h): a TileProgram checks its code once when it is
// made (every operation known, every register and array index in range), then runs it over
// numpy arrays with the GIL released, checking each call's arrays against the loads and stores.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "kernels.h"
#include "rule.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace jax_mlpo {
namespace {

using Code = nb::ndarray<const int32_t, nb::ndim<2>, nb::c_contig, nb::device::cpu>;
using Scalars = nb::ndarray<const float, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using ReadArray = nb::ndarray<nb::ro, nb::c_contig, nb::device::cpu>;
using WriteArray = nb::ndarray<nb::c_contig, nb::device::cpu>;

constexpr int kOperands[kRuleOpCount] = {
#define JAX_MLPO_RULE_ARITY(name, operands) operands,
    JAX_MLPO_RULE_OPS(JAX_MLPO_RULE_ARITY)
#undef JAX_MLPO_RULE_ARITY
};

[[noreturn]] void Invalid(const std::string& what) {
  throw nb::value_error(("TileProgram: " + what).c_str());
}

std::vector<int32_t> Copied(const Code& code, const char* part) {
  if (code.shape(1) != kRuleWords) Invalid(std::string(part) + " must have 5 words a row");
  return {code.data(), code.data() + code.size()};
}

// What an array index must hold: its element type, and whether a store writes it.
struct ArrayUse {
  int bf16 = -1;  // unknown until a load or store names it
  bool written = false;
};

class TileProgram {
 public:
  TileProgram(const Code& prologue, const Code& setup, const Code& body, size_t scalar_regs,
              size_t tile_regs, size_t arrays)
      : prologue_(Copied(prologue, "prologue")),
        setup_(Copied(setup, "setup")),
        body_(Copied(body, "body")),
        scalar_regs_(scalar_regs),
        tile_regs_(tile_regs),
        uses_(arrays) {
    for (size_t k = 0; k < prologue_.size(); k += kRuleWords) {
      const int32_t* in = &prologue_[k];
      CheckOperation(in, scalar_regs_, "prologue");
    }
    for (size_t k = 0; k < setup_.size(); k += kRuleWords) {
      const int32_t* in = &setup_[k];
      if (in[0] != kRuleBroadcast) Invalid("the setup holds broadcasts only");
      CheckRegister(in[1], tile_regs_, "setup");
      CheckRegister(in[2], scalar_regs_, "setup");
    }
    const size_t regs = tile_regs_ + uses_.size();  // the arrays' own registers follow
    for (size_t k = 0; k < body_.size(); k += kRuleWords) {
      const int32_t* in = &body_[k];
      const bool load = in[0] == kRuleLoadF32 || in[0] == kRuleLoadBf16;
      const bool store = in[0] == kRuleStoreF32 || in[0] == kRuleStoreBf16;
      if (load || store) {
        const int32_t array = load ? in[2] : in[1];
        CheckRegister(load ? in[1] : in[2], load ? tile_regs_ : regs, "body");
        if (array < 0 || size_t(array) >= uses_.size()) Invalid("an array index out of range");
        Use(size_t(array), in[0] == kRuleLoadBf16 || in[0] == kRuleStoreBf16, store);
      } else {
        CheckOperation(in, regs, "body");
        for (int j = 1; j < 5; ++j) {  // an array's register: a float32 array, written if dst
          if (in[j] >= int32_t(tile_regs_)) Use(size_t(in[j]) - tile_regs_, false, j == 1);
        }
      }
    }
  }

  void Run(const Scalars& scalars, const std::vector<nb::handle>& arrays) const {
    if (scalars.size() != scalar_regs_) Invalid("scalars must fill the scalar registers");
    if (arrays.size() != uses_.size()) Invalid("wrong number of arrays");
    // the arrays, kept until the call ends; a written one must be writable
    std::vector<ReadArray> read(arrays.size());
    std::vector<WriteArray> written(arrays.size());
    std::vector<void*> data(arrays.size());
    size_t n = 0;
    for (size_t i = 0; i < arrays.size(); ++i) {
      const ArrayUse& use = uses_[i];
      nb::dlpack::dtype dtype;
      size_t size;
      if (use.written) {
        if (!nb::try_cast(arrays[i], written[i], false)) {
          Invalid("array " + std::to_string(i) + " must be a writable, contiguous host array");
        }
        dtype = written[i].dtype(), size = written[i].size(), data[i] = written[i].data();
      } else {
        if (!nb::try_cast(arrays[i], read[i], false)) {
          Invalid("array " + std::to_string(i) + " must be a contiguous host array");
        }
        dtype = read[i].dtype(), size = read[i].size();
        data[i] = const_cast<void*>(read[i].data());
      }
      const nb::dlpack::dtype want = use.bf16 == 1 ? nb::dtype<uint16_t>() : nb::dtype<float>();
      if (use.bf16 >= 0 && dtype != want) {
        Invalid("array " + std::to_string(i) + " must be " +
                (use.bf16 ? "bfloat16 bits (uint16)" : "float32"));
      }
      if (i == 0) n = size;
      if (size != n) Invalid("the arrays differ in size");
    }
    // a load reads an array in place unless a written array shares its memory (an update
    // written over its gradient)
    std::vector<char> viewable(arrays.size());
    const size_t width = sizeof(float);
    for (size_t i = 0; i < arrays.size(); ++i) {
      if (uses_[i].written || uses_[i].bf16 != 0) continue;
      const char* lo = static_cast<const char*>(data[i]);
      bool shared = false;
      for (size_t j = 0; j < arrays.size(); ++j) {
        const char* other = static_cast<const char*>(data[j]);
        const size_t bytes = n * (uses_[j].bf16 == 1 ? 2 : width);
        shared |= uses_[j].written && lo < other + bytes && other < lo + n * width;
      }
      viewable[i] = !shared;
    }
    RuleArgs a{prologue_.data(), prologue_.size() / kRuleWords,
               setup_.data(),    setup_.size() / kRuleWords,
               body_.data(),     body_.size() / kRuleWords,
               scalars.data(),   scalar_regs_,
               tile_regs_,       data.data(),
               data.size(),      reinterpret_cast<const bool*>(viewable.data())};
    if (n == 0) return;
    nb::gil_scoped_release release;
    Rule(a, n);
  }

 private:
  void Use(size_t array, bool bf16, bool written) {
    ArrayUse& use = uses_[array];
    if (use.bf16 >= 0 && use.bf16 != int(bf16)) Invalid("an array used as two types");
    use.bf16 = bf16;
    use.written |= written;
  }

  static void CheckRegister(int32_t r, size_t count, const char* part) {
    if (r < 0 || size_t(r) >= count) Invalid(std::string("a register out of range in the ") + part);
  }

  static void CheckOperation(const int32_t* in, size_t regs, const char* part) {
    const int32_t op = in[0];
    if (op <= kRuleBroadcast || op >= kRuleOpCount) {
      Invalid(std::string("an unknown operation in the ") + part);
    }
    CheckRegister(in[1], regs, part);
    for (int k = 0; k < 3; ++k) {
      if (k < kOperands[op]) {
        CheckRegister(in[2 + k], regs, part);
        if (in[2 + k] == in[1]) Invalid("an operation writes one of its operands");
      } else if (in[2 + k] != -1) {
        Invalid(std::string("an unused operand must be -1 in the ") + part);
      }
    }
  }

  std::vector<int32_t> prologue_, setup_, body_;
  size_t scalar_regs_, tile_regs_;
  std::vector<ArrayUse> uses_;
};

}  // namespace

void BindRule(nb::module_& m) {
  std::vector<std::string> names(kRuleOpNames, kRuleOpNames + kRuleOpCount);
  m.attr("RULE_OPS") = nb::cast(names);
  m.attr("RULE_TILE") = kRuleTile;
  nb::class_<TileProgram>(m, "TileProgram",
                          "A jax.numpy rule compiled into a tile program (rule_program.py).")
      .def(nb::init<const Code&, const Code&, const Code&, size_t, size_t, size_t>(),
           "prologue"_a.noconvert(), "setup"_a.noconvert(), "body"_a.noconvert(),
           "scalar_regs"_a, "tile_regs"_a, "arrays"_a)
      .def("run", &TileProgram::Run, "scalars"_a.noconvert(), "arrays"_a,
           "Runs the program over the arrays (float32, or bfloat16 as uint16 bits).");
}

}  // namespace jax_mlpo
