// Collectives over a shared-memory segment for ranks on one host, split into post and wait
// (braid/distributed/shm.py maps the segment and explains the protocol; braid/native.py builds
// this file). Operators, so that eager steps and compiled graphs run the same code, and
// inductor's C++ wrapper calls them without a trip through Python:
//
// - `shm_post(x, sequence, ring) -> ticket`: copy x's first slot-sized chunk into this rank's
//   next slot and publish it; the ticket (a one-element int64 tensor) carries the operation
//   number, which the wait takes, so a compiler cannot move the wait before its post.
// - `shm_all_reduce(ticket, x, residual?, sequence, ring)`: post the later chunks one at a time;
//   for each, wait until every rank has published it, sum all ranks' chunks in rank order
//   (16-bit terms in fp32, the residual added before the one rounding), release the slot.
// - `shm_all_gather(ticket, x, rows, collect, sequence, ring)`: every rank's rows concatenated;
//   ranks that do not `collect` (a gather to rank 0) release each chunk once it is posted.
//
// Every operator writes the number of the ring's latest operation into `sequence` (a one-element
// int64 tensor of the communicator's), which its schema declares mutated: a compiler keeps the
// operators in program order along that chain and never drops one whose result goes unused (a
// rank's part of a gather to rank 0), as every rank must issue every collective.
//
// Header words are loaded with acquire and stored with release semantics (plain moves on x86).
// A long wait releases Python's GIL, so the rank's other threads (its parent watch) run.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/full.h>
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <Python.h>
#include <sched.h>

#include <chrono>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "vec_io.h"

namespace {

constexpr int64_t HEADER_WORDS = 8;  // int64 words per (rank, slot): one cache line
constexpr int PUBLISHED = 0, CONSUMED = 1;
constexpr int64_t SPINS_BEFORE_YIELD = 10000;  // about a millisecond of pauses
constexpr int64_t YIELDS_BEFORE_SLEEP = 2000;

// A rank's view of one segment. Its bookkeeping (`next_op`, `slot_of`, `held`, `last_op`,
// `last_slot`) and the `rings` table are plain, unlocked state: one thread per process issues
// a rank's collectives (its model thread, which opened the ring; eager and compiled steps alike),
// and operation numbers must follow program order on every rank. `ring_of` refuses any other
// thread rather than let two interleave.
struct Ring {
  int64_t* header;
  char* data;
  int64_t world, rank, slots, slot_bytes;
  double timeout_s;
  std::thread::id owner = std::this_thread::get_id();  // the thread that opened it
  int64_t next_op = 1;
  std::unordered_map<int64_t, int64_t> slot_of;  // posted, unreleased operation -> its slot
  std::vector<char> held;                        // slots of such operations
  std::vector<int64_t> last_op;                  // the latest operation each slot carried
  int64_t last_slot;

  int64_t* word(int64_t r, int64_t slot, int field) {
    return header + (r * slots + slot) * HEADER_WORDS + field;
  }
  char* chunk(int64_t r, int64_t slot) { return data + (r * slots + slot) * slot_bytes; }
};

std::vector<std::unique_ptr<Ring>> rings;

Ring& ring_of(int64_t id) {
  TORCH_CHECK(id >= 0 && id < int64_t(rings.size()) && rings[id], "no open shm ring ", id);
  TORCH_CHECK(rings[id]->owner == std::this_thread::get_id(), "shm ring ", id,
              " used from a thread other than the one that opened it (its state is the "
              "opening thread's alone)");
  return *rings[id];
}

// Releases the GIL while held, where this thread holds it (eager calls from Python).
class GilRelease {
 public:
  GilRelease() : state_(Py_IsInitialized() && PyGILState_Check() ? PyEval_SaveThread() : nullptr) {}
  ~GilRelease() {
    if (state_) PyEval_RestoreThread(state_);
  }

 private:
  PyThreadState* state_;
};

// Until every rank's `field` word of `slot` reaches `value`: spin, then yield, then sleep; on
// timeout the error names the ranks that did not `what`.
void spin(Ring& ring, int field, int64_t slot, int64_t value, const char* what, int64_t op) {
  auto missing = [&](std::vector<int64_t>* who) {
    bool any = false;
    for (int64_t r = 0; r < ring.world; ++r) {
      if (__atomic_load_n(ring.word(r, slot, field), __ATOMIC_ACQUIRE) < value) {
        any = true;
        if (!who) return true;
        who->push_back(r);
      }
    }
    return any;
  };
  for (int64_t i = 0; i < SPINS_BEFORE_YIELD; ++i) {
    if (!missing(nullptr)) return;
    _mm_pause();
  }
  GilRelease unlocked;
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::duration<double>(ring.timeout_s);
  for (int64_t i = 0; missing(nullptr); ++i) {
    if (i < YIELDS_BEFORE_SLEEP) {
      sched_yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
    if (std::chrono::steady_clock::now() > deadline) {
      std::vector<int64_t> who;
      if (!missing(&who)) return;
      std::string names;
      for (int64_t r : who) names += (names.empty() ? "" : ", ") + std::to_string(r);
      TORCH_CHECK(false, "shm on rank ", ring.rank, ": rank(s) ", names, " did not ", what,
                  " #", op, " within ", int64_t(ring.timeout_s), " s");
    }
  }
}

// The next operation number and this rank's slot for it, free on every rank. Round robin,
// skipping slots held by posted operations not yet waited (another micro-batch's), so a
// collective of more chunks than slots cycles through the free ones.
std::pair<int64_t, int64_t> reserve(Ring& ring) {
  const int64_t op = ring.next_op++;
  int64_t slot = ring.last_slot;
  int64_t tried = 0;
  do {
    slot = (slot + 1) % ring.slots;
    TORCH_CHECK(++tried <= ring.slots, "more than ", ring.slots, " shm collectives in flight");
  } while (ring.held[slot]);
  spin(ring, CONSUMED, slot, ring.last_op[slot], "release", op);
  ring.slot_of[op] = slot;
  ring.held[slot] = 1;
  ring.last_op[slot] = op;
  ring.last_slot = slot;
  return {op, slot};
}

int64_t post_chunk(Ring& ring, const char* bytes, int64_t nbytes) {
  const auto [op, slot] = reserve(ring);
  if (nbytes) std::memcpy(ring.chunk(ring.rank, slot), bytes, nbytes);
  __atomic_store_n(ring.word(ring.rank, slot, PUBLISHED), op, __ATOMIC_RELEASE);
  return op;
}

int64_t arrive(Ring& ring, int64_t op) {
  const int64_t slot = ring.slot_of.at(op);
  spin(ring, PUBLISHED, slot, op, "publish", op);
  return slot;
}

void release(Ring& ring, int64_t op) {
  const int64_t slot = ring.slot_of.at(op);
  ring.slot_of.erase(op);
  ring.held[slot] = 0;
  __atomic_store_n(ring.word(ring.rank, slot, CONSUMED), op, __ATOMIC_RELEASE);
}

int64_t chunk_elems(const Ring& ring, const at::Tensor& x) {
  return ring.slot_bytes / int64_t(x.element_size());
}

void check_input(const at::Tensor& x, const char* what) {
  TORCH_CHECK(x.device().is_cpu() && x.is_contiguous(), what,
              " must be a contiguous CPU tensor");
}

// out[i] = parts[0][i] + parts[1][i] + ... (+ residual[i]), in fp32, rounded once to T.
template <typename T>
void sum_span(const std::vector<const T*>& parts, const T* residual, T* out, int64_t n) {
  using braid_vec::load;
  using braid_vec::Vec;
  using braid_vec::VL;
  for (int64_t i = 0; i < n; i += VL) {
    const int64_t m = std::min(VL, n - i);
    Vec acc = load(parts[0] + i, m);
    for (size_t r = 1; r < parts.size(); ++r) acc = acc + load(parts[r] + i, m);
    if (residual) acc = acc + load(residual + i, m);
    braid_vec::store(acc, out + i, m);
  }
}

template <typename T>
void sum_parallel(const std::vector<const char*>& chunks, const at::Tensor& residual,
                  at::Tensor& out, int64_t start, int64_t n) {
  std::vector<const T*> parts;
  for (const char* c : chunks) parts.push_back(reinterpret_cast<const T*>(c));
  const T* res = residual.defined() ? residual.data_ptr<T>() + start : nullptr;
  T* dst = out.data_ptr<T>() + start;
  at::parallel_for(0, n, 1 << 15, [&](int64_t b, int64_t e) {
    std::vector<const T*> shifted;
    for (const T* p : parts) shifted.push_back(p + b);
    sum_span(shifted, res ? res + b : nullptr, dst + b, e - b);
  });
}

// Other dtypes (integers, float64): ATen adds, in the same order.
void sum_generic(const std::vector<const char*>& chunks, const at::Tensor& residual,
                 at::Tensor& out, int64_t start, int64_t n) {
  auto part = [&](const char* c) {
    return at::from_blob(const_cast<char*>(c), {n}, out.options());
  };
  at::Tensor acc = part(chunks[0]).clone();
  for (size_t r = 1; r < chunks.size(); ++r) acc.add_(part(chunks[r]));
  if (residual.defined()) acc.add_(residual.view(-1).narrow(0, start, n));
  out.view(-1).narrow(0, start, n).copy_(acc);
}

// Checked before an operator does anything: `record` writes its one element.
void check_sequence(const at::Tensor& sequence) {
  TORCH_CHECK(sequence.device().is_cpu() && sequence.scalar_type() == at::kLong &&
                  sequence.numel() == 1,
              "sequence must be a one-element int64 CPU tensor, got ", sequence.scalar_type(),
              " with ", sequence.numel(), " elements");
}

void record(const Ring& ring, at::Tensor& sequence) {
  sequence.data_ptr<int64_t>()[0] = ring.next_op - 1;
}

at::Tensor shm_post(const at::Tensor& x, at::Tensor& sequence, int64_t ring_id) {
  check_sequence(sequence);
  Ring& ring = ring_of(ring_id);
  check_input(x, "x");
  const int64_t first = std::min(x.numel(), chunk_elems(ring, x));
  const int64_t op = post_chunk(ring, static_cast<const char*>(x.data_ptr()),
                                first * int64_t(x.element_size()));
  record(ring, sequence);
  return at::full({1}, op, at::TensorOptions().dtype(at::kLong));
}

at::Tensor shm_all_reduce(const at::Tensor& ticket, const at::Tensor& x,
                          const std::optional<at::Tensor>& residual, at::Tensor& sequence,
                          int64_t ring_id) {
  check_sequence(sequence);
  Ring& ring = ring_of(ring_id);
  check_input(x, "x");
  at::Tensor res;
  if (residual.has_value()) {
    res = *residual;
    check_input(res, "residual");
    TORCH_CHECK(res.sizes() == x.sizes() && res.scalar_type() == x.scalar_type(),
                "residual must have x's shape and dtype");
  }
  at::Tensor out = at::empty_like(x, at::MemoryFormat::Contiguous);
  const int64_t step = chunk_elems(ring, x), itemsize = x.element_size();
  const char* src = static_cast<const char*>(x.data_ptr());
  int64_t op = ticket.item<int64_t>();
  for (int64_t start = 0; start == 0 || start < x.numel(); start += step) {
    const int64_t n = std::min(step, x.numel() - start);
    if (start) op = post_chunk(ring, src + start * itemsize, n * itemsize);
    const int64_t slot = arrive(ring, op);
    std::vector<const char*> chunks;
    for (int64_t r = 0; r < ring.world; ++r) chunks.push_back(ring.chunk(r, slot));
    if (n > 0) {
      switch (x.scalar_type()) {
        case at::kFloat: sum_parallel<float>(chunks, res, out, start, n); break;
        case at::kBFloat16: sum_parallel<at::BFloat16>(chunks, res, out, start, n); break;
        case at::kHalf: sum_parallel<at::Half>(chunks, res, out, start, n); break;
        default: sum_generic(chunks, res, out, start, n);
      }
    }
    release(ring, op);
  }
  record(ring, sequence);
  return out;
}

// `rows` is a SymInt[] (a compiled graph's row counts may be symbols); inductor's C++ wrapper
// passes them as a generic list, which an int[] kernel argument would refuse.
at::Tensor shm_all_gather(const at::Tensor& ticket, const at::Tensor& x,
                          c10::SymIntArrayRef row_symbols, bool collect, at::Tensor& sequence,
                          int64_t ring_id) {
  check_sequence(sequence);
  const std::vector<int64_t> rows = C10_AS_INTARRAYREF_SLOW(row_symbols).vec();
  Ring& ring = ring_of(ring_id);
  check_input(x, "x");
  TORCH_CHECK(int64_t(rows.size()) == ring.world, "rows must list every rank's row count");
  TORCH_CHECK(x.dim() >= 1 && x.size(0) == rows[ring.rank], "x must have ", rows[ring.rank],
              " rows");
  int64_t row_elems = 1;
  for (int64_t d = 1; d < x.dim(); ++d) row_elems *= x.size(d);
  std::vector<int64_t> numels, offsets;
  int64_t total = 0, largest = 0;
  for (int64_t r : rows) {
    offsets.push_back(total);
    numels.push_back(r * row_elems);
    total += r * row_elems;
    largest = std::max(largest, r * row_elems);
  }
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape[0] = 0;
  if (collect) {
    for (int64_t r : rows) shape[0] += r;
  }
  at::Tensor out = at::empty(shape, x.options().memory_format(at::MemoryFormat::Contiguous));
  const int64_t step = chunk_elems(ring, x), itemsize = x.element_size();
  const int64_t num_chunks = std::max<int64_t>(1, (largest + step - 1) / step);
  const char* src = static_cast<const char*>(x.data_ptr());
  char* dst = static_cast<char*>(out.data_ptr());
  const int64_t mine = numels[ring.rank];
  int64_t op = ticket.item<int64_t>();
  for (int64_t i = 0; i < num_chunks; ++i) {
    const int64_t begin = i * step;
    if (i) {
      const int64_t n = std::max<int64_t>(0, std::min(step, mine - begin));
      op = post_chunk(ring, src + std::min(begin, mine) * itemsize, n * itemsize);
    }
    if (collect) {
      const int64_t slot = arrive(ring, op);
      for (int64_t r = 0; r < ring.world; ++r) {
        const int64_t n = std::max<int64_t>(0, std::min(step, numels[r] - begin));
        if (n) std::memcpy(dst + (offsets[r] + begin) * itemsize, ring.chunk(r, slot), n * itemsize);
      }
    }
    release(ring, op);
  }
  record(ring, sequence);
  return out;
}

int64_t shm_open(int64_t address, int64_t world, int64_t rank, int64_t slots, int64_t slot_bytes,
                 double timeout_s) {
  auto ring = std::make_unique<Ring>();
  ring->header = reinterpret_cast<int64_t*>(address);
  const int64_t header_bytes = world * (slots + 1) * HEADER_WORDS * 8;
  ring->data = reinterpret_cast<char*>(address) + header_bytes;
  ring->world = world;
  ring->rank = rank;
  ring->slots = slots;
  ring->slot_bytes = slot_bytes;
  ring->timeout_s = timeout_s;
  ring->held.assign(slots, 0);
  ring->last_op.assign(slots, 0);
  ring->last_slot = slots - 1;
  rings.push_back(std::move(ring));
  return int64_t(rings.size()) - 1;
}

void shm_set_timeout(int64_t ring_id, double timeout_s) { ring_of(ring_id).timeout_s = timeout_s; }

void shm_close(int64_t ring_id) {
  if (ring_id >= 0 && ring_id < int64_t(rings.size())) rings[ring_id].reset();
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(braid, m) {
  m.def("shm_open(int address, int world, int rank, int slots, int slot_bytes, float timeout_s) "
        "-> int");
  m.def("shm_set_timeout(int ring, float timeout_s) -> ()");
  m.def("shm_close(int ring) -> ()");
  m.def("shm_post(Tensor x, Tensor(a!) sequence, int ring) -> Tensor");
  m.def("shm_all_reduce(Tensor ticket, Tensor x, Tensor? residual, Tensor(a!) sequence, "
        "int ring) -> Tensor");
  m.def("shm_all_gather(Tensor ticket, Tensor x, SymInt[] rows, bool collect, "
        "Tensor(a!) sequence, int ring) -> Tensor");
}

TORCH_LIBRARY_IMPL(braid, CPU, m) {
  m.impl("shm_post", &shm_post);
  m.impl("shm_all_reduce", &shm_all_reduce);
  m.impl("shm_all_gather", &shm_all_gather);
}

TORCH_LIBRARY_IMPL(braid, CompositeExplicitAutograd, m) {
  m.impl("shm_open", &shm_open);
  m.impl("shm_set_timeout", &shm_set_timeout);
  m.impl("shm_close", &shm_close);
}
