// vdev streams, events, synchronizations and the asynchronous mode.
//
// Included by vdev.cpp inside `namespace vdev`, after the counters and the allocators.
//
// Compute on vdev runs when it is issued (the fallback calls the CPU kernel at once), so
// what a GPU does later has to be modelled where the host can observe it:
//
//   * synchronizations are counted per device, in the three kinds CUDA's sync debug mode
//     reports: a blocking copy between host and device (`tensor.cpu()`, `.to(dev)` without
//     non_blocking, a non-blocking copy into pageable memory), a host read of device
//     memory (`.item()`, `bool(t)`, `float(t)`), and an explicit wait (stream, event or
//     device synchronize). torch.vdev.set_sync_debug_mode("warn"/"error") warns at, or
//     refuses, each one, so a Python traceback names the line that synchronized.
//   * streams: each thread has a current stream per device (0 is the default stream);
//     torch.Stream / torch.Event / torch.accelerator work on vdev as on a GPU.
//   * the asynchronous mode (VDEV_ASYNC=1 or torch.vdev.set_async(True)):
//       - a non-blocking copy from the device into pinned host memory does not land until
//         the host synchronizes with its stream (stream/event/device synchronize, a query
//         that reports completion, or a synchronizing op on that stream); until then the
//         destination holds 0xFF bytes (NaN), as on a GPU the bytes are simply not there yet;
//       - a non-blocking copy from pinned host memory to the device reads its source when the
//         device gets to it: the first device op that touches the destination, or a
//         synchronization; the host overwriting the source before then changes what arrives;
//       - the device runs behind the host by VDEV_QUEUE_DEPTH ops per stream (default 64):
//         an event query (or stream query) says "done" only for work at least that many
//         ops back, or that the host has synchronized past, so reading a result right
//         after queuing it must wait — a synchronization, counted — while reading it a
//         step later does not (a query that keeps failing lets the device catch up after
//         1000 polls, as time would);
//       - every op runs on the current stream; an op that reads or writes memory last
//         written on another stream that it has not waited for (an event recorded after the
//         write and waited on, or a host synchronization) is refused by name — the race a
//         GPU would run silently.
//     Not modelled: the caching allocator's reuse of memory freed while another stream
//     still uses it (record_stream), reads racing later writes on another stream, timing.

// ---------------------------------------------------------------------------------------
// synchronizations

enum class SyncKind { kCopy, kRead, kWait };

std::atomic<int> g_sync_debug_mode{0};  // 0: count only, 1: warn, 2: error

void note_sync(int device, SyncKind kind, const std::string& what) {
  const int mode = g_sync_debug_mode.load();
  TORCH_CHECK(mode != 2, "vdev: synchronizing operation (", what, ") while "
              "torch.vdev.set_sync_debug_mode(\"error\") is on: the host would wait for the "
              "device here. Keep the value on the device, or copy it with non_blocking=True "
              "into pinned memory and read it after an event says it has landed");
  if (mode == 1) TORCH_WARN("vdev: synchronizing operation: ", what);
  auto& c = g_counters[device];
  switch (kind) {
    case SyncKind::kCopy: c.sync_copies += 1; break;
    case SyncKind::kRead: c.sync_reads += 1; break;
    case SyncKind::kWait: c.sync_waits += 1; break;
  }
}

// ---------------------------------------------------------------------------------------
// streams and the asynchronous mode's bookkeeping

bool async_from_env() { return env_int("VDEV_ASYNC", 0) != 0; }
std::atomic<bool> g_async{async_from_env()};

constexpr int64_t kPoolStreams = 8;  // ids 1..8: getStreamFromGlobalPool, round robin
constexpr int64_t kPollsToCatchUp = 1000;

int64_t queue_depth() {
  static const int64_t depth = std::max<int64_t>(0, env_int64("VDEV_QUEUE_DEPTH", 64));
  return depth;
}

struct StreamState {
  int64_t issued = 0;     // ops issued on the stream; an op's position is the count after it
  int64_t completed = 0;  // the host has seen every op up to here finish
  int64_t polls = 0;      // queries that found work unfinished since the last progress
  std::unordered_map<int64_t, int64_t> waited;  // other stream -> position this one waited for
};

// A copy issued but not yet done (asynchronous mode only).
struct Pending {
  int64_t stream;
  int64_t pos;
  bool to_host;         // device -> pinned host (src: a host snapshot) or pinned host -> device
  at::Tensor dst;
  at::Tensor src;
  const void* storage;  // the device storage the copy writes (host -> device), else nullptr
};

struct Access {
  int64_t stream;
  int64_t pos;
};

struct DeviceStreams {
  std::recursive_mutex mu;  // recursive: dropping a tensor under the lock frees device memory
  int64_t next_new = kPoolStreams + 1;
  int64_t next_pool = 0;
  std::unordered_map<int64_t, StreamState> streams;
  std::deque<Pending> pending;                          // issue order, all streams
  std::unordered_map<const void*, Access> last_write;  // device storage -> its last writer
};

std::array<DeviceStreams, kMaxDevices> g_streams;
thread_local std::array<int64_t, kMaxDevices> t_current_stream{};  // zeros: default streams

int64_t current_stream(int device) { return t_current_stream[device]; }

// The memory of a device tensor as the bookkeeping knows it: its storage's base pointer.
const void* storage_key(const at::Tensor& t) {
  return (t.defined() && t.has_storage()) ? t.storage().data() : nullptr;
}

void forget_storage(int device, const void* base) {  // the allocator freed it
  if (!g_async.load()) return;
  auto& ds = g_streams[device];
  std::lock_guard<std::recursive_mutex> lock(ds.mu);
  ds.last_write.erase(base);
}

void do_copy(Pending& p);  // vdev.cpp: the bytes of a pending copy, moved now

// Run stream *stream*'s pending copies up to position *upto* (in issue order) and record
// that the host has seen the stream get there.
void complete_until(DeviceStreams& ds, int64_t stream, int64_t upto) {
  std::vector<Pending> done;
  for (auto it = ds.pending.begin(); it != ds.pending.end();) {
    if (it->stream == stream && it->pos <= upto) {
      do_copy(*it);
      done.push_back(std::move(*it));
      it = ds.pending.erase(it);
    } else {
      ++it;
    }
  }
  auto& s = ds.streams[stream];
  s.completed = std::max(s.completed, upto);
}

void complete_stream(DeviceStreams& ds, int64_t stream) {
  complete_until(ds, stream, ds.streams[stream].issued);
}

// Has the device reached position *pos* of *stream*? (queries: see the top of the file)
bool reached(DeviceStreams& ds, int64_t stream, int64_t pos) {
  auto& s = ds.streams[stream];
  if (pos <= std::max(s.completed, s.issued - queue_depth()) || ++s.polls > kPollsToCatchUp) {
    s.polls = 0;
    complete_until(ds, stream, pos);
    return true;
  }
  return false;
}

void complete_device(DeviceStreams& ds) {
  std::vector<int64_t> ids;
  for (const auto& [id, _] : ds.streams) ids.push_back(id);
  for (int64_t id : ids) complete_stream(ds, id);
}

// A device op on *stream* is about to touch *storage*: refuse it if the memory's last
// writer is another stream it is not ordered after; run the pending copy into it first.
void order_access(DeviceStreams& ds, const std::string& what, int device, int64_t stream,
                  const void* storage) {
  if (storage == nullptr) return;
  auto w = ds.last_write.find(storage);
  if (w != ds.last_write.end() && w->second.stream != stream) {
    const Access a = w->second;
    const auto& writer = ds.streams[a.stream];
    const auto& mine = ds.streams[stream];
    auto waited = mine.waited.find(a.stream);
    const bool ordered = writer.completed >= a.pos ||
                         (waited != mine.waited.end() && waited->second >= a.pos);
    TORCH_CHECK(ordered, "vdev (asynchronous mode): ", what, " on stream ", stream,
                " of vdev:", device, " uses memory that stream ", a.stream,
                " wrote and that this stream has not waited for: on a GPU the two race. "
                "Record an event on stream ", a.stream, " after the write and wait for it "
                "on this stream (event.record(); stream.wait_event(event), or "
                "stream.wait_stream), or synchronize that stream first");
  }
  for (auto it = ds.pending.rbegin(); it != ds.pending.rend(); ++it) {
    if (it->storage == storage) {
      complete_until(ds, it->stream, it->pos);
      break;
    }
  }
}

// Issue one device op on the current stream: its ordering checks now, its position back.
struct DeviceOp {
  int device = 0;
  int64_t stream = 0;
  int64_t pos = 0;
  bool tracked = false;

  DeviceOp(const std::string& what, int device_index, const std::vector<const void*>& touched) {
    if (!g_async.load()) return;
    tracked = true;
    device = device_index;
    stream = current_stream(device);
    auto& ds = g_streams[device];
    std::lock_guard<std::recursive_mutex> lock(ds.mu);
    for (const void* s : touched) order_access(ds, what, device, stream, s);
    pos = ++ds.streams[stream].issued;
  }

  void wrote(const void* storage) const {
    if (!tracked || storage == nullptr) return;
    auto& ds = g_streams[device];
    std::lock_guard<std::recursive_mutex> lock(ds.mu);
    ds.last_write[storage] = Access{stream, pos};
  }
};

// A synchronizing op on the current stream: everything issued there before it is done.
void sync_current_stream(int device) {
  if (!g_async.load()) return;
  auto& ds = g_streams[device];
  std::lock_guard<std::recursive_mutex> lock(ds.mu);
  complete_stream(ds, current_stream(device));
}

void defer(int device, Pending p) {
  auto& ds = g_streams[device];
  std::lock_guard<std::recursive_mutex> lock(ds.mu);
  ds.pending.push_back(std::move(p));
}

int64_t pending_count(int device) {
  auto& ds = g_streams[device];
  std::lock_guard<std::recursive_mutex> lock(ds.mu);
  return static_cast<int64_t>(ds.pending.size());
}

void set_async(bool on) {
  if (!on) {  // leaving the mode: nothing may stay pending
    for (int d = 0; d < device_count(); ++d) {
      auto& ds = g_streams[d];
      std::lock_guard<std::recursive_mutex> lock(ds.mu);
      complete_device(ds);
      ds.last_write.clear();
    }
  }
  g_async = on;
}

// ---------------------------------------------------------------------------------------
// events: a position on a stream

// A stream's device index (a stream of "vdev" without an index is on the current device).
int device_of(const c10::Stream& s) {
  return s.device_index() >= 0 ? s.device_index() : t_current_device;
}

struct Event {
  int device;
  int64_t stream = -1;  // -1: never recorded
  int64_t pos = 0;
};

void record_event(void** event, const c10::Stream& stream, c10::DeviceIndex device) {
  const int on = device_of(stream);
  if (*event == nullptr) *event = new Event{device >= 0 ? static_cast<int>(device) : on};
  auto* e = static_cast<Event*>(*event);
  TORCH_CHECK(e->device == on, "vdev: an event of vdev:", e->device,
              " cannot be recorded on a stream of vdev:", on);
  auto& ds = g_streams[e->device];
  std::lock_guard<std::recursive_mutex> lock(ds.mu);
  e->stream = stream.id();
  e->pos = ds.streams[stream.id()].issued;
}

void block_on_event(void* event, const c10::Stream& stream) {
  auto* e = static_cast<Event*>(event);
  if (e == nullptr || e->stream < 0) return;
  TORCH_CHECK(device_of(stream) == e->device, "vdev: a stream of vdev:", device_of(stream),
              " cannot wait for an event of vdev:", e->device);
  auto& ds = g_streams[e->device];
  std::lock_guard<std::recursive_mutex> lock(ds.mu);
  int64_t& waited = ds.streams[stream.id()].waited[e->stream];
  waited = std::max(waited, e->pos);
}

// Has the work before the event finished? (the queue-depth model, top of the file)
bool query_event(void* event) {
  auto* e = static_cast<Event*>(event);
  if (e == nullptr || e->stream < 0) return true;
  auto& ds = g_streams[e->device];
  std::lock_guard<std::recursive_mutex> lock(ds.mu);
  return reached(ds, e->stream, e->pos);
}

void synchronize_event(void* event) {
  auto* e = static_cast<Event*>(event);
  if (e == nullptr || e->stream < 0) return;
  note_sync(e->device, SyncKind::kWait, "event synchronize");
  auto& ds = g_streams[e->device];
  std::lock_guard<std::recursive_mutex> lock(ds.mu);
  complete_until(ds, e->stream, e->pos);
}

// ---------------------------------------------------------------------------------------
// the device guard: current device and current stream per thread

struct GuardImpl final : c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override { return c10::DeviceType::PrivateUse1; }

  c10::Device exchangeDevice(c10::Device d) const override {
    const c10::Device old = getDevice();
    if (d.index() != old.index()) setDevice(d);
    return old;
  }
  c10::Device getDevice() const override {
    return c10::Device(c10::DeviceType::PrivateUse1, t_current_device);
  }
  void setDevice(c10::Device d) const override {
    TORCH_CHECK(d.is_privateuseone(), "vdev: cannot make ", d, " the current device");
    if (d.has_index()) {
      check_index(d.index());
      t_current_device = d.index();
    }
  }
  void uncheckedSetDevice(c10::Device d) const noexcept override {
    if (d.has_index()) t_current_device = d.index();
  }
  static c10::Device indexed(c10::Device d) {
    return d.has_index() ? d : c10::Device(c10::DeviceType::PrivateUse1, t_current_device);
  }
  // noexcept: torch 2.4 declares getStream / exchangeStream noexcept, later releases do
  // not (a stricter override is valid there); neither can throw here
  c10::Stream getStream(c10::Device d) const noexcept override {
    d = indexed(d);
    return c10::Stream(c10::Stream::UNSAFE, d, current_stream(d.index()));
  }
  c10::Stream getDefaultStream(c10::Device d) const override {
    return c10::Stream(c10::Stream::DEFAULT, indexed(d));
  }
  c10::Stream getStreamFromGlobalPool(c10::Device d, bool) const override {
    d = indexed(d);
    auto& ds = g_streams[d.index()];
    std::lock_guard<std::recursive_mutex> lock(ds.mu);
    const int64_t id = 1 + (ds.next_pool++ % kPoolStreams);
    return c10::Stream(c10::Stream::UNSAFE, d, id);
  }
  c10::Stream getNewStream(c10::Device d, int) const override {
    d = indexed(d);
    auto& ds = g_streams[d.index()];
    std::lock_guard<std::recursive_mutex> lock(ds.mu);
    return c10::Stream(c10::Stream::UNSAFE, d, ds.next_new++);
  }
  c10::Stream exchangeStream(c10::Stream s) const noexcept override {
    const c10::Stream old = getStream(s.device());
    t_current_stream[device_of(s)] = s.id();
    return old;
  }
  c10::DeviceIndex deviceCount() const noexcept override {
    return static_cast<c10::DeviceIndex>(device_count());
  }
  void record(void** event, const c10::Stream& stream, const c10::DeviceIndex device,
              const c10::EventFlag) const override {
    record_event(event, stream, device);
  }
  void block(void* event, const c10::Stream& stream) const override {
    block_on_event(event, stream);
  }
  bool queryEvent(void* event) const override { return query_event(event); }
  void synchronizeEvent(void* event) const override { synchronize_event(event); }
  void destroyEvent(void* event, const c10::DeviceIndex) const noexcept override {
    delete static_cast<Event*>(event);
  }
  bool queryStream(const c10::Stream& s) const override {
    auto& ds = g_streams[device_of(s)];
    std::lock_guard<std::recursive_mutex> lock(ds.mu);
    return reached(ds, s.id(), ds.streams[s.id()].issued);
  }
  void synchronizeStream(const c10::Stream& s) const override {
    note_sync(device_of(s), SyncKind::kWait, "stream synchronize");
    auto& ds = g_streams[device_of(s)];
    std::lock_guard<std::recursive_mutex> lock(ds.mu);
    complete_stream(ds, s.id());
  }
  // VDEV_OVERRIDE_SINCE_2_8: see the version guard in vdev.cpp (torch 2.4 has no such hook)
  void synchronizeDevice(const c10::DeviceIndex index) const VDEV_OVERRIDE_SINCE_2_8 {
    const int device = index < 0 ? t_current_device : index;
    note_sync(device, SyncKind::kWait, "device synchronize");
    auto& ds = g_streams[device];
    std::lock_guard<std::recursive_mutex> lock(ds.mu);
    complete_device(ds);
  }
};
