#include "testing/workloads.h"

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <new>

#include "optfuse/error.h"
#include "runtime/thread_pool.h"

namespace optfuse::testing {

namespace {

void add(Workload& w, const std::string& name, int64_t rows, int64_t cols = 1) {
  w.tensors.push_back({name, rows * cols});
}

// GPT-2 small as the optimizer sees it: the LM head is tied to wte, so it is not a parameter.
Workload gpt2_small() {
  Workload w;
  const int64_t d = 768;
  add(w, "wte.weight", 50257, d);
  add(w, "wpe.weight", 1024, d);
  for (int b = 0; b < 12; ++b) {
    std::string p = "h." + std::to_string(b) + ".";
    add(w, p + "ln_1.weight", d);
    add(w, p + "ln_1.bias", d);
    add(w, p + "attn.c_attn.weight", d, 3 * d);
    add(w, p + "attn.c_attn.bias", 3 * d);
    add(w, p + "attn.c_proj.weight", d, d);
    add(w, p + "attn.c_proj.bias", d);
    add(w, p + "ln_2.weight", d);
    add(w, p + "ln_2.bias", d);
    add(w, p + "mlp.c_fc.weight", d, 4 * d);
    add(w, p + "mlp.c_fc.bias", 4 * d);
    add(w, p + "mlp.c_proj.weight", 4 * d, d);
    add(w, p + "mlp.c_proj.bias", d);
  }
  add(w, "ln_f.weight", d);
  add(w, "ln_f.bias", d);
  return w;
}

// Llama 3.2 1B: grouped-query attention (8 KV heads of 64), SwiGLU MLP, RMSNorm (no biases), and
// an untied head so that both 128256 x 2048 matrices are stepped.
Workload llama_1b() {
  Workload w;
  const int64_t d = 2048, kv = 512, ff = 8192, vocab = 128256;
  add(w, "embed_tokens.weight", vocab, d);
  for (int b = 0; b < 16; ++b) {
    std::string p = "layers." + std::to_string(b) + ".";
    add(w, p + "input_layernorm.weight", d);
    add(w, p + "self_attn.q_proj.weight", d, d);
    add(w, p + "self_attn.k_proj.weight", kv, d);
    add(w, p + "self_attn.v_proj.weight", kv, d);
    add(w, p + "self_attn.o_proj.weight", d, d);
    add(w, p + "post_attention_layernorm.weight", d);
    add(w, p + "mlp.gate_proj.weight", ff, d);
    add(w, p + "mlp.up_proj.weight", ff, d);
    add(w, p + "mlp.down_proj.weight", d, ff);
  }
  add(w, "norm.weight", d);
  add(w, "lm_head.weight", vocab, d);
  return w;
}

Workload many_small() {
  Workload w;
  for (int i = 0; i < 2000; ++i) add(w, "t" + std::to_string(i), 4096);
  return w;
}

Workload one_tensor(int64_t n) {
  Workload w;
  add(w, "t0", n);
  return w;
}

uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

constexpr size_t kAlign = 64;

size_t round_up(size_t n, size_t a) { return (n + a - 1) / a * a; }

}  // namespace

int64_t Workload::total_elements() const {
  int64_t n = 0;
  for (const NamedTensor& t : tensors) n += t.numel;
  return n;
}

std::vector<TensorSpec> Workload::specs(int group) const {
  std::vector<TensorSpec> s;
  s.reserve(tensors.size());
  for (const NamedTensor& t : tensors) s.push_back({t.numel, group});
  return s;
}

std::vector<std::string> workload_names() {
  return {"gpt2-small", "llama-1b", "many-small", "one-big", "cpu-default"};
}

Workload make_workload(const std::string& name, double scale) {
  if (!(scale > 0) || !std::isfinite(scale))
    throw Error("workload scale must be a positive finite number, got " + std::to_string(scale));
  Workload w;
  if (name == "gpt2-small") w = gpt2_small();
  else if (name == "llama-1b") w = llama_1b();
  else if (name == "many-small") w = many_small();
  else if (name == "one-big") w = one_tensor(int64_t{1} << 28);
  else if (name == "cpu-default") w = one_tensor(int64_t{1} << 26);
  else {
    std::string known;
    for (const std::string& k : workload_names()) known += (known.empty() ? "" : ", ") + k;
    throw Error("unknown workload '" + name + "' (known: " + known + ")");
  }
  w.name = name;
  w.scale = scale;
  if (scale != 1.0)
    for (NamedTensor& t : w.tensors)
      // Truncation, as bench/workload_shapes.py does, so both sides step identical shapes.
      t.numel = std::max<int64_t>(1, static_cast<int64_t>(static_cast<double>(t.numel) * scale));
  return w;
}

int64_t plan_bytes_per_element(const Plan& plan, DType dtype) {
  int64_t per = 0;
  for (size_t i = 0; i < plan.phases.size(); ++i) {  // (16-bit states written ahead: the recomputing forms)
    const ElementPhase& ph = plan.phase_for(i, dtype == DType::f32 || dtype == DType::f64);
    per += ph.reads() + ph.writes();
  }
  return per * static_cast<int64_t>(dtype_size(dtype));
}

void fill_host(void* p, int64_t n, DType dtype, bool random, double value, uint64_t seed) {
  // Fixed blocks: which thread fills a block never changes its bytes.
  const int64_t block = int64_t{1} << 20;
  const int64_t blocks = (n + block - 1) / block;
  const float constant = static_cast<float>(value);
  const uint16_t c_bf16 = float_to_bf16_bits(constant), c_f16 = float_to_f16_bits(constant);
  const uint64_t key = splitmix64(seed);
  default_thread_pool().parallel_for(blocks, [&](int64_t b0, int64_t b1) {
    for (int64_t i = b0 * block, end = std::min(n, b1 * block); i < end; ++i) {
      float x = constant;
      if (random) {
        // 23 random bits k -> (k + 0.5) / 2^22 - 1 = (2k + 1) / 2^23 - 1: uniform in (-1, 1), every
        // step exact in float (k + 0.5 needs 24 significant bits, no more), never 0.
        uint64_t r = splitmix64(key ^ static_cast<uint64_t>(i)) >> 41;
        x = (static_cast<float>(r) + 0.5f) * (1.0f / 4194304.0f) - 1.0f;
      }
      switch (dtype) {
        case DType::f32: static_cast<float*>(p)[i] = x; break;
        case DType::bf16: static_cast<uint16_t*>(p)[i] = random ? float_to_bf16_bits(x) : c_bf16; break;
        case DType::f16: static_cast<uint16_t*>(p)[i] = random ? float_to_f16_bits(x) : c_f16; break;
        case DType::i16: static_cast<int16_t*>(p)[i] = 0; break;  // master-weight remainders start at 0
        case DType::f64: {
          // 52 random bits k -> (2k + 1) / 2^52 - 1: uniform in (-1, 1), exact in double, never 0.
          const uint64_t k = splitmix64(key ^ static_cast<uint64_t>(i)) >> 12;
          static_cast<double*>(p)[i] = random ? (static_cast<double>(k) + 0.5) * std::ldexp(1.0, -51) - 1.0 : value;
          break;
        }
      }
    }
  });
}

struct HostWorkloadMemory::Arena {
  void* data = nullptr;
  size_t bytes = 0;
  explicit Arena(size_t n) : bytes(n) {
    data = std::aligned_alloc(kAlign, round_up(std::max<size_t>(n, 1), kAlign));
    if (!data) throw Error("out of host memory: cannot allocate " + std::to_string(n) + " bytes for a workload");
  }
  ~Arena() { std::free(data); }
};

HostWorkloadMemory::HostWorkloadMemory(const Plan& plan, const Workload& w, DType dtype, uint64_t seed) {
  const size_t roles = 2 + static_cast<size_t>(plan.num_states());
  const size_t esize = dtype_size(dtype);
  std::vector<size_t> offsets;
  size_t total = 0;
  for (const NamedTensor& t : w.tensors) {
    offsets.push_back(total);
    total += round_up(static_cast<size_t>(t.numel) * esize, kAlign);
  }
  for (size_t r = 0; r < roles; ++r) {
    arenas_.push_back(std::make_unique<Arena>(total));
    char* base = static_cast<char*>(arenas_.back()->data);
    // One fill per tensor: padding between tensors stays untouched (never read).
    for (size_t t = 0; t < w.tensors.size(); ++t) {
      bool random = r < 2;
      double init = random ? 0.0 : plan.program.states[r - 2].init;
      fill_host(base + offsets[t], w.tensors[t].numel, dtype, random, init, seed * 1000003u + r * 7919u + t);
    }
  }
  for (size_t t = 0; t < w.tensors.size(); ++t) {
    auto buf = [&](size_t role) {
      return Buffer{static_cast<char*>(arenas_[role]->data) + offsets[t], w.tensors[t].numel, dtype};
    };
    TensorRef ref;
    ref.param = buf(0);
    ref.grad = buf(1);
    for (size_t r = 2; r < roles; ++r) ref.states.push_back(buf(r));
    refs_.push_back(ref);
  }
}

HostWorkloadMemory::~HostWorkloadMemory() = default;

size_t HostWorkloadMemory::bytes() const {
  size_t n = 0;
  for (const auto& a : arenas_) n += a->bytes;
  return n;
}

}  // namespace optfuse::testing
