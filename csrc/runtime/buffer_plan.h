/*
 * buffer_plan.h: typed views of one device allocation, laid out once by a BufferPlan: a handle's
 * slot (pool.cc) and the rail buffers of a group that spans nodes (nodes.cc). No offset is
 * computed by hand.
 *
 * NOTES:
 *  - Every view starts at a multiple of its alignment (256 bytes unless asked) from the base, so
 *    with a 256-byte aligned base (cudaMalloc's, or alloc_fn's: checked) every view can be read
 *    and written in 16-byte vectors.
 */
#pragma once

#include <stddef.h>

#include <vector>

namespace nccl_ep {

inline size_t align_up(size_t v, size_t a) { return (v + a - 1) / a * a; }

// A typed view of a part of a buffer: its place is decided once, by BufferPlan.
template <typename T>
struct View {
  T* ptr = nullptr;
  size_t count = 0;
  size_t bytes() const { return sizeof(T) * count; }
};

// Lays out views one after another in one allocation (each aligned), then binds them to a base.
class BufferPlan {
 public:
  template <typename T>
  void add(View<T>* v, size_t count, size_t align = 256) {
    offset_ = align_up(offset_, align);
    v->count = count;
    v->ptr = reinterpret_cast<T*>(offset_);  // an offset until bind()
    bound_.push_back(reinterpret_cast<void**>(&v->ptr));
    offset_ += sizeof(T) * count;
  }
  // A view of one T whose storage is `bytes` long (a struct with a flexible tail).
  template <typename T>
  void add_bytes(View<T>* v, size_t bytes, size_t align = 256) {
    add(v, 1, align);
    offset_ += bytes - sizeof(T);
  }
  size_t bytes() const { return offset_ == 0 ? 16 : offset_; }
  void bind(void* base) {
    for (void** p : bound_) *p = reinterpret_cast<char*>(base) + reinterpret_cast<size_t>(*p);
    bound_.clear();
  }

 private:
  size_t offset_ = 0;
  std::vector<void**> bound_;
};

}  // namespace nccl_ep
