#include "parallel/exchange.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <string>

#include "core/error.h"
#include "parallel/exchange_internal.h"

namespace statescan {
namespace {

struct Dims {
  int64_t maps, dk, dv, m_size;
  bool diagonal;
  int64_t state() const { return dk * dv; }
};

Dims dims_of(const ScanMaps& s) { return {s.maps(), s.dk, s.dv, s.m_size(), s.diagonal}; }

// out[Dk x w] = M in[Dk x w] + E[:, c0:c0+w] for one map. `in` and `out` have
// row stride w, E row stride dv; in == nullptr means a zero incoming state.
void apply_map(const Dims& d, const float* M, const float* E, const float* in, float* out,
               int64_t c0, int64_t w) {
  for (int64_t i = 0; i < d.dk; ++i) {
    float* o = out + i * w;
    const float* e = E + i * d.dv + c0;
    for (int64_t c = 0; c < w; ++c) o[c] = e[c];
    if (in == nullptr) continue;
    if (d.diagonal) {
      const float m = M[i];
      const float* s = in + i * w;
      for (int64_t c = 0; c < w; ++c) o[c] += m * s[c];
    } else {
      for (int64_t j = 0; j < d.dk; ++j) {
        const float m = M[i * d.dk + j];
        const float* s = in + j * w;
        for (int64_t c = 0; c < w; ++c) o[c] += m * s[c];
      }
    }
  }
}

// E_l <- M_l E_e + E_l for every map: the E half of compose_into, and all
// that the tree's last round needs. M_l is not changed.
void compose_e_into(const Dims& d, const float* Ml_all, float* El_all, const float* Ee_all) {
  std::vector<float> e_new(static_cast<std::size_t>(d.state()));
  for (int64_t m = 0; m < d.maps; ++m) {
    float* El = El_all + m * d.state();
    apply_map(d, Ml_all + m * d.m_size, El, Ee_all + m * d.state(), e_new.data(), 0, d.dv);
    std::copy(e_new.begin(), e_new.end(), El);
  }
}

// (M_l, E_l) <- (M_l, E_l) ∘ (M_e, E_e) = (M_l M_e, M_l E_e + E_l) for every map.
// Buffers are packed as [all M | all E] (see pack()).
void compose_into(const Dims& d, float* later, const float* earlier) {
  float* Ml_all = later;
  const float* Me_all = earlier;
  // E first: it needs every M_l before it is replaced.
  compose_e_into(d, Ml_all, later + d.maps * d.m_size, earlier + d.maps * d.m_size);
  std::vector<float> m_new(static_cast<std::size_t>(d.m_size));
  for (int64_t m = 0; m < d.maps; ++m) {
    float* Ml = Ml_all + m * d.m_size;
    const float* Me = Me_all + m * d.m_size;
    if (d.diagonal) {
      for (int64_t i = 0; i < d.dk; ++i) Ml[i] *= Me[i];
      continue;
    }
    std::fill(m_new.begin(), m_new.end(), 0.f);
    for (int64_t i = 0; i < d.dk; ++i)
      for (int64_t j = 0; j < d.dk; ++j) {
        const float a = Ml[i * d.dk + j];
        const float* row = Me + j * d.dk;
        float* out = m_new.data() + i * d.dk;
        for (int64_t c = 0; c < d.dk; ++c) out[c] += a * row[c];
      }
    std::copy(m_new.begin(), m_new.end(), Ml);
  }
}

std::vector<float> pack(const ScanMaps& s) {
  std::vector<float> buf(s.M);
  buf.insert(buf.end(), s.E.begin(), s.E.end());
  return buf;
}

using exchange_detail::Order;

constexpr int kTagRing = 7101, kTagTree = 7102;

int64_t scan_allgather(Communicator& comm, const ScanMaps& s, const Order& ord, float* S) {
  const Dims d = dims_of(s);
  const std::vector<float> mine = pack(s);
  const std::size_t n = mine.size();
  std::vector<float> all(n * static_cast<std::size_t>(ord.size));
  comm.all_gather(mine.data(), all.data(), n, CommType::f32);
  // S_in = compose predecessors in scan order, applied to a zero start.
  std::fill(S, S + d.maps * d.state(), 0.f);
  std::vector<float> next(static_cast<std::size_t>(d.state()));
  for (int p = 0; p < ord.pos(); ++p) {
    const float* buf = all.data() + n * static_cast<std::size_t>(ord.rank_at(p));
    for (int64_t m = 0; m < d.maps; ++m) {
      float* st = S + m * d.state();
      apply_map(d, buf + m * d.m_size, buf + d.maps * d.m_size + m * d.state(),
                p == 0 ? nullptr : st, next.data(), 0, d.dv);
      std::copy(next.begin(), next.end(), st);
    }
  }
  return static_cast<int64_t>(n * sizeof(float)) * (ord.size - 1);
}

int64_t scan_ring(Communicator& comm, const ScanMaps& s, const Order& ord, float* S) {
  const Dims d = dims_of(s);
  const int prev = ord.rank_at(ord.pos() - 1), next = ord.rank_at(ord.pos() + 1);
  std::fill(S, S + d.maps * d.state(), 0.f);
  // Blocks along Dv (exchange_detail::ring_block_width).
  const int64_t width = exchange_detail::ring_block_width(d.dv);
  std::vector<float> in, out;
  int64_t sent = 0;
  for (int64_t c0 = 0; c0 < d.dv; c0 += width) {
    const int64_t w = std::min(width, d.dv - c0);
    const std::size_t block = static_cast<std::size_t>(d.maps * d.dk * w);
    in.assign(block, 0.f);
    if (prev >= 0) comm.recv(in.data(), block, CommType::f32, prev, kTagRing);
    // Unpack the incoming block into S (this rank's S_in).
    for (int64_t m = 0; m < d.maps; ++m)
      for (int64_t i = 0; i < d.dk; ++i)
        std::copy_n(in.data() + (m * d.dk + i) * w, w, S + m * d.state() + i * d.dv + c0);
    if (next < 0) continue;
    out.resize(block);
    for (int64_t m = 0; m < d.maps; ++m)
      apply_map(d, s.M.data() + m * d.m_size, s.E.data() + m * d.state(),
                prev >= 0 ? in.data() + m * d.dk * w : nullptr, out.data() + m * d.dk * w, c0, w);
    comm.send(out.data(), block, CommType::f32, next, kTagRing);
    sent += static_cast<int64_t>(block * sizeof(float));
  }
  return sent;
}

int64_t scan_tree(Communicator& comm, const ScanMaps& s, const Order& ord, float* S) {
  const Dims d = dims_of(s);
  const std::size_t map_floats = static_cast<std::size_t>(d.maps * d.m_size),
                    state_floats = static_cast<std::size_t>(d.maps * d.state());
  // Exclusive Kogge-Stone scan in ceil(log2 P) rounds. Before the round with
  // distance `dist`, acc at position p composes positions
  // max(0, p-dist+1)..p and excl max(0, p-dist+1)..p-1: what arrives from
  // p-dist (its acc) extends both by dist positions. So excl holds something
  // from the second round on (p > 0 received in the first), and after the
  // scan exactly where p > 0. The last round sends only acc's E, since the
  // receiver needs no map after it: its excl's E becomes M_excl E_got +
  // E_excl, which is S_in.
  std::vector<float> acc = pack(s), excl(acc.size()), got(acc.size());
  int64_t sent = 0;
  for (int dist = 1; dist < ord.size; dist *= 2) {
    const bool last = 2 * dist >= ord.size;
    const int to = ord.rank_at(ord.pos() + dist), from = ord.rank_at(ord.pos() - dist);
    const std::size_t n = last ? state_floats : acc.size();
    const float* send = last ? acc.data() + map_floats : acc.data();
    comm.send_recv(send, n, to, got.data(), n, from, CommType::f32, kTagTree);
    if (to >= 0) sent += static_cast<int64_t>(n * sizeof(float));
    if (from < 0) continue;
    if (last) {
      // S_in = M_excl E_got + E_excl (E_got alone where nothing came before).
      if (dist > 1)
        compose_e_into(d, excl.data(), excl.data() + map_floats, got.data());
      else
        std::copy_n(got.data(), state_floats, excl.data() + map_floats);
      break;
    }
    // acc is read again only if a later round has a receiver for it.
    if (ord.rank_at(ord.pos() + 2 * dist) >= 0) compose_into(d, acc.data(), got.data());
    if (dist > 1)
      compose_into(d, excl.data(), got.data());
    else
      excl = got;
  }
  if (ord.pos() > 0)
    std::copy_n(excl.data() + map_floats, state_floats, S);
  else
    std::fill(S, S + state_floats, 0.f);
  return sent;
}

}  // namespace

void check_scan_dims(int64_t rows, int64_t heads, int64_t dk, int64_t dv) {
  SS_CHECK_ARG(rows >= 1, "maps.rows", "must be >= 1, got ", rows);
  SS_CHECK_ARG(heads >= 1, "maps.heads", "must be >= 1, got ", heads);
  SS_CHECK_ARG(dk >= 1, "maps.dk", "must be >= 1, got ", dk);
  SS_CHECK_ARG(dv >= 1, "maps.dv", "must be >= 1, got ", dv);
}

ScanResult exclusive_scan(Communicator& comm, Exchange strategy, const ScanMaps& maps,
                          ScanOrder order) {
  check_scan_dims(maps.rows, maps.heads, maps.dk, maps.dv);
  SS_CHECK_ARG(maps.M.size() == static_cast<std::size_t>(maps.maps() * maps.m_size()), "maps.M",
               "holds ", maps.M.size(), " floats, expected ", maps.maps() * maps.m_size());
  SS_CHECK_ARG(maps.E.size() == static_cast<std::size_t>(maps.maps() * maps.dk * maps.dv),
               "maps.E", "holds ", maps.E.size(), " floats, expected ",
               maps.maps() * maps.dk * maps.dv);
  ScanResult r;
  r.incoming.assign(maps.E.size(), 0.f);
  const Order ord{comm.rank(), comm.size(), order == ScanOrder::reverse};
  if (ord.size == 1) return r;
  switch (strategy) {
    case Exchange::allgather:
      r.bytes_sent = scan_allgather(comm, maps, ord, r.incoming.data());
      break;
    case Exchange::ring: r.bytes_sent = scan_ring(comm, maps, ord, r.incoming.data()); break;
    case Exchange::tree: r.bytes_sent = scan_tree(comm, maps, ord, r.incoming.data()); break;
    case Exchange::automatic: SS_FAIL("exchange", "must be resolved before the scan");
  }
  return r;
}

namespace {

// One message's fixed cost and its bandwidth.
struct Hop {
  double latency_s, bandwidth_Bps;
};

bool hierarchical(const LinkModel& link, int ranks) {
  return link.gpus_per_node > 0 && ranks > link.gpus_per_node;
}

// The link between scan positions a and b (consecutive ranks share a node).
Hop hop_between(const LinkModel& link, int a, int b) {
  if (link.gpus_per_node > 0 && a / link.gpus_per_node != b / link.gpus_per_node)
    return {link.inter_latency_s, link.inter_bandwidth_Bps};
  return {link.latency_s, link.bandwidth_Bps};
}

// The slowest link any rank uses in a step in which all ranks talk at once
// (a collective round is as slow as its slowest pair).
Hop slowest_hop(const LinkModel& link, int ranks) {
  if (hierarchical(link, ranks)) return {link.inter_latency_s, link.inter_bandwidth_Bps};
  return {link.latency_s, link.bandwidth_Bps};
}

}  // namespace

double predicted_exchange_seconds(Exchange e, int ranks, int64_t map_bytes, int64_t state_bytes,
                                  int64_t apply_flops, const LinkModel& link) {
  if (ranks <= 1) return 0.0;
  const double P = ranks;
  const Hop slow = slowest_hop(link, ranks);
  const double a = slow.latency_s, bw = slow.bandwidth_Bps;
  const double apply_s = static_cast<double>(apply_flops) / link.compose_flops_per_s;
  switch (e) {
    case Exchange::allgather:
      // Ring all-gather of P maps (each of its P-1 steps as slow as the
      // slowest link), then up to P-1 map applications locally.
      return (P - 1) * (a + map_bytes / bw) + (P - 1) * apply_s;
    case Exchange::ring: {
      // P-1 dependent hops, each applying one map, pipelined over the blocks:
      // the first block crosses every hop, the others follow one slowest hop
      // apart. On one flat link this is (P-1 + blocks-1) equal hop times.
      const double blocks = static_cast<double>(exchange_detail::kRingBlocks);
      double first_block = 0, slowest = 0;
      for (int r = 0; r + 1 < ranks; ++r) {
        const Hop h = hop_between(link, r, r + 1);
        const double t = h.latency_s + state_bytes / blocks / h.bandwidth_Bps + apply_s / blocks;
        first_block += t;
        slowest = std::max(slowest, t);
      }
      return first_block + (blocks - 1) * slowest;
    }
    case Exchange::tree: {
      // Every round but the last sends maps; composing two maps costs about
      // an application plus a Dk^3 product, taken as two applications. The
      // first round composes one (acc; excl is what arrived), the middle ones
      // two (acc and excl). The last sends E and applies one map, except at
      // P = 2, where it is the only round and E is copied.
      const double rounds = std::ceil(std::log2(P));
      if (rounds == 1) return a + state_bytes / bw;
      return (a + map_bytes / bw + 2 * apply_s) +
             (rounds - 2) * (a + map_bytes / bw + 4 * apply_s) + a + state_bytes / bw + apply_s;
    }
    case Exchange::automatic:
      break;
  }
  return std::numeric_limits<double>::infinity();
}

int64_t predicted_exchange_bytes(Exchange e, int ranks, int64_t map_bytes, int64_t state_bytes) {
  if (ranks <= 1) return 0;
  switch (e) {
    case Exchange::allgather:
      return map_bytes * (ranks - 1);
    case Exchange::ring:
      return state_bytes;
    case Exchange::tree: {
      int64_t rounds = 0;
      for (int dist = 1; dist < ranks; dist *= 2) ++rounds;
      return (rounds - 1) * map_bytes + state_bytes;
    }
    case Exchange::automatic:
      break;
  }
  SS_FAIL("exchange", "must be resolved before predicting its bytes");
}

const char* to_string(LinkPreset p) {
  switch (p) {
    case LinkPreset::nvlink:
      return "nvlink";
    case LinkPreset::ib:
      return "ib";
    case LinkPreset::hierarchical:
      return "hierarchical";
  }
  return "?";
}

LinkPreset parse_link_preset(std::string_view name, const char* argument) {
  for (LinkPreset p : {LinkPreset::nvlink, LinkPreset::ib, LinkPreset::hierarchical})
    if (name == to_string(p)) return p;
  SS_FAIL(argument, "'", std::string(name), "' is not a link (nvlink, ib, hierarchical)");
}

LinkModel link_preset(LinkPreset preset, int gpus_per_node) {
  SS_CHECK_ARG(gpus_per_node >= 1, "gpus_per_node", "must be >= 1, got ", gpus_per_node);
  // NVLink 4 (H100/H200 SXM): 18 links x 50 GB/s bidirectional = 900 GB/s per
  // GPU, 450 GB/s per direction. NCCL reaches about 360 GB/s bus bandwidth on
  // 8x H100 ("360 GB/s is exactly what we'd expect on H100", NVIDIA/nccl-tests
  // issue 326): the achievable figure is used. Small-message NCCL latency
  // within a node is a few microseconds (about 6 us for a 2-GPU all-reduce,
  // NVIDIA/nccl issue 1259); 8 us per message is assumed for send/recv.
  constexpr double kNvlinkBps = 360e9, kNvlinkLatency = 8e-6;
  // NDR InfiniBand, one 400 Gb/s ConnectX-7 NIC per GPU (DGX/HGX H100/H200):
  // 50 GB/s per direction, of which NCCL reaches 46-48 GB/s per NIC
  // (NVIDIA/nccl-tests issue 290). Small-message NCCL latency across nodes is
  // taken as 15 us (wire latency is ~1-2 us; NCCL's per-step proxy cost
  // dominates, ~10-12 us per step in NVIDIA/nccl issue 2409).
  constexpr double kIbBps = 46e9, kIbLatency = 15e-6;
  // Composing maps runs on the GPU: fp32 maps on tensor cores (3xTF32 or
  // fp32-accumulate) at an assumed achievable 300 TFLOP/s of H200's 989 TF32
  // dense peak; small per-head GEMMs rarely do better.
  constexpr double kGpuComposeFlops = 300e12;
  LinkModel m;
  m.compose_flops_per_s = kGpuComposeFlops;
  switch (preset) {
    case LinkPreset::nvlink:
      m.latency_s = kNvlinkLatency;
      m.bandwidth_Bps = kNvlinkBps;
      break;
    case LinkPreset::ib:
      m.latency_s = kIbLatency;
      m.bandwidth_Bps = kIbBps;
      break;
    case LinkPreset::hierarchical:
      m.latency_s = kNvlinkLatency;
      m.bandwidth_Bps = kNvlinkBps;
      m.gpus_per_node = gpus_per_node;
      m.inter_latency_s = kIbLatency;
      m.inter_bandwidth_Bps = kIbBps;
      break;
  }
  return m;
}

LinkModel link_from_ring_probe(const RingProbe& probe, const LinkModel& base) {
  constexpr int kWarmup = 2, kReps = 7;
  constexpr std::size_t kSmall = 2;  // floats: 8 B
  auto median_seconds = [&](std::size_t floats) {
    std::vector<double> times;
    for (int i = 0; i < kWarmup + kReps; ++i) {
      const double s = probe.shift(floats);
      if (i >= kWarmup) times.push_back(s);
    }
    std::nth_element(times.begin(), times.begin() + kReps / 2, times.end());
    return times[kReps / 2];
  };
  const double small = median_seconds(kSmall), large = median_seconds(probe.large);
  // The slowest pair sets every round (as the model assumes): max over ranks
  // of the latency and of the seconds per byte. A transfer under a quarter of
  // the latency is noise, not a bandwidth: that rank votes "unresolved".
  const double extra_bytes = static_cast<double>((probe.large - kSmall) * sizeof(float));
  const bool resolved = large - small >= 0.25 * small;
  double worst[3] = {std::max(small, 1e-7),
                     resolved ? (large - small) / extra_bytes : 1.0 / base.bandwidth_Bps,
                     resolved ? 0.0 : 1.0};
  probe.agree_max(worst, 3);
  LinkModel m = base;
  m.latency_s = worst[0];
  m.bandwidth_measured = worst[2] == 0.0;
  m.bandwidth_Bps = m.bandwidth_measured ? 1.0 / worst[1] : base.bandwidth_Bps;
  return m;
}

LinkModel measure_link(Communicator& comm, const LinkModel& base) {
  const int P = comm.size(), r = comm.rank();
  if (P == 1) return base;
  constexpr int kTag = 7311;
  RingProbe probe;
  probe.large = 1 << 18;  // 1 MiB
  std::vector<float> send(probe.large, 1.f), recv(probe.large);
  const int next = (r + 1) % P, prev = (r + P - 1) % P;
  probe.shift = [&](std::size_t count) {
    comm.barrier();  // start together: a late peer is not link time
    const auto t0 = std::chrono::steady_clock::now();
    comm.send_recv(send.data(), count, next, recv.data(), count, prev, CommType::f32, kTag);
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  probe.agree_max = [&](double* values, int n) {
    comm.all_reduce_max(values, static_cast<std::size_t>(n), CommType::f64);
  };
  return link_from_ring_probe(probe, base);
}

Exchange resolve_exchange(Exchange requested, int ranks, int64_t map_bytes, int64_t state_bytes,
                          int64_t apply_flops, const LinkModel& link) {
  if (requested != Exchange::automatic) return requested;
  Exchange best = Exchange::ring;
  double best_s = std::numeric_limits<double>::infinity();
  for (Exchange e : {Exchange::ring, Exchange::allgather, Exchange::tree}) {
    const double t =
        predicted_exchange_seconds(e, ranks, map_bytes, state_bytes, apply_flops, link);
    if (t < best_s) {
      best_s = t;
      best = e;
    }
  }
  return best;
}

}  // namespace statescan
