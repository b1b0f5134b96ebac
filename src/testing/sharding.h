// Sharded steps in one process, for tests: tensors cut into rank pieces at chunk boundaries (as
// optfuse.torch.distributed.ZeRO cuts them) and a bus that plays the all-gather of an exchange
// (Optimizer::set_exchange) between ranks running as threads.
#pragma once
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <vector>

#include "optfuse/optimizer.h"

namespace optfuse::testing {

struct ShardPiece {
  size_t tensor;
  int64_t begin, end;  // elements of the tensor
};

struct ShardCut {
  int64_t global_chunks = 0;
  std::vector<int64_t> first_chunk, num_chunks;  // per tensor, in the global chunk order
  std::vector<std::vector<ShardPiece>> pieces;   // per rank, in tensor order
  std::vector<int64_t> rank_first_chunk;         // per rank: its first global chunk
  // Rank r's exchange map: each piece's whole-tensor span.
  ShardMap map(int rank) const;
};

// Cuts the tensors, laid end to end, into `ranks` contiguous ranges of about equal size; a cut falls
// on a tensor start or a multiple of `chunk` elements into a tensor.
ShardCut cut_into_ranks(const std::vector<int64_t>& sizes, int64_t chunk, int ranks);

// The all-gather of an exchange between `ranks` threads: each rank's partials go to its columns of
// a shared [reduction][global chunk] table, then every rank reads all of it. Device partials go
// through the host (synchronous copies on the step's default stream).
class PartialsBus {
 public:
  PartialsBus(int ranks, size_t reductions, int64_t global_chunks);
  ExchangeFn exchange(int64_t first_column);

 private:
  void wait();
  int ranks_;
  int64_t global_;
  std::vector<double> table_;
  std::mutex mu_;
  std::condition_variable cv_;
  int count_ = 0, generation_ = 0;
};

}  // namespace optfuse::testing
