#include "testing/sharding.h"

#include <algorithm>

#include "runtime/cuda_api.h"

namespace optfuse::testing {

ShardMap ShardCut::map(int rank) const {
  ShardMap m;
  m.global_chunks = global_chunks;
  for (const ShardPiece& pc : pieces[static_cast<size_t>(rank)]) m.tensors.push_back({first_chunk[pc.tensor], num_chunks[pc.tensor]});
  return m;
}

ShardCut cut_into_ranks(const std::vector<int64_t>& sizes, int64_t chunk, int ranks) {
  ShardCut c;
  std::vector<int64_t> starts, cuts;
  int64_t total = 0;
  for (int64_t n : sizes) {
    c.first_chunk.push_back(c.global_chunks);
    c.num_chunks.push_back((n + chunk - 1) / chunk);
    c.global_chunks += c.num_chunks.back();
    starts.push_back(total);
    for (int64_t e = 0; e < n; e += chunk) cuts.push_back(total + e);
    total += n;
  }
  cuts.push_back(total);
  std::vector<int64_t> bounds = {0};
  for (int r = 1; r < ranks; ++r) bounds.push_back(*std::prev(std::upper_bound(cuts.begin(), cuts.end(), total * r / ranks)));
  bounds.push_back(total);
  c.pieces.resize(static_cast<size_t>(ranks));
  c.rank_first_chunk.assign(static_cast<size_t>(ranks), c.global_chunks);
  for (int r = 0; r < ranks; ++r)
    for (size_t t = 0; t < sizes.size(); ++t) {
      const int64_t a = std::max(bounds[static_cast<size_t>(r)], starts[t]) - starts[t];
      const int64_t b = std::min(bounds[static_cast<size_t>(r) + 1], starts[t] + sizes[t]) - starts[t];
      if (a >= b) continue;
      if (c.pieces[static_cast<size_t>(r)].empty()) c.rank_first_chunk[static_cast<size_t>(r)] = c.first_chunk[t] + a / chunk;
      c.pieces[static_cast<size_t>(r)].push_back({t, a, b});
    }
  return c;
}

PartialsBus::PartialsBus(int ranks, size_t reductions, int64_t global_chunks)
    : ranks_(ranks), global_(global_chunks), table_(reductions * static_cast<size_t>(global_chunks), 0.0) {}

void PartialsBus::wait() {
  std::unique_lock<std::mutex> lock(mu_);
  const int gen = generation_;
  if (++count_ == ranks_) {
    count_ = 0;
    ++generation_;
    cv_.notify_all();
  } else {
    cv_.wait(lock, [&] { return generation_ != gen; });
  }
}

ExchangeFn PartialsBus::exchange(int64_t first_column) {
  return [this, first_column](const PartialSums& ps) {
    const size_t G = static_cast<size_t>(global_), n = static_cast<size_t>(ps.local_chunks);
    for (int row : ps.reductions) {  // this rank's columns (all-gather, part 1)
      double* dst = table_.data() + static_cast<size_t>(row) * G + static_cast<size_t>(first_column);
      const double* src = ps.local + static_cast<size_t>(row) * n;
      if (n == 0) continue;
      if (ps.on_device)
        cuda::copy_to_host(dst, reinterpret_cast<CUdeviceptr>(src), n * sizeof(double), nullptr);
      else
        std::copy(src, src + n, dst);
    }
    wait();
    for (int row : ps.reductions) {  // every rank's (part 2)
      const double* src = table_.data() + static_cast<size_t>(row) * G;
      double* dst = ps.global + static_cast<size_t>(row) * G;
      if (ps.on_device)
        cuda::copy_to_device(reinterpret_cast<CUdeviceptr>(dst), src, G * sizeof(double), nullptr);
      else
        std::copy(src, src + G, dst);
    }
    wait();  // nobody writes the next exchange's columns before every rank has read these
  };
}

}  // namespace optfuse::testing
