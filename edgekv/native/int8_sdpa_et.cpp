// edgekv::int8_sdpa.out, edgekv::fp16_sdpa.out and edgekv::packed_sdpa.out, ExecuTorch kernels registered into the
// runtime's kernel registry when this library is loaded (EXECUTORCH_LIBRARY: a static initializer calling executorch::runtime::register_kernel),
// plus plain C entry points for tests. The ops' schemas and eager references are edgekv/native/__init__.py's; an app
// that runs a .pte calling them links this file (with int8_sdpa_core.cpp) beside ExecuTorch's runtime.
//
//   int8_sdpa.out(Tensor q, Tensor k_codes, Tensor v_codes, Tensor k_scale, Tensor v_scale, SymInt start_pos,
//                 float scale, bool per_channel, *, Tensor(a!) out) -> Tensor(a!)
//   q [Hkv, C, G, D] fp32; k_codes, v_codes int8 with Hkv*T*D elements ([1, Hkv, T, D] or [Hkv, T, 1, D]);
//   per_channel false (kv-int8): k_scale, v_scale Hkv*T fp16 or fp32 scales, one per token and head;
//   per_channel true (kv-int8c): [Hkv, D] fp32 static scales. out [Hkv, C, G, D] fp32.
//
//   fp16_sdpa.out(Tensor q, Tensor k, Tensor v, SymInt start_pos, float scale, *, Tensor(a!) out) -> Tensor(a!)
//   q [Hkv, C, G, D] fp32; k, v fp16 with Hkv*T*D elements (the fp16 cache in place); out [Hkv, C, G, D] fp32.
//
//   packed_sdpa.out(Tensor q, Tensor k_codes, Tensor v_codes, Tensor k_scale, Tensor k_zero, Tensor v_scale,
//                   Tensor v_zero, SymInt start_pos, float scale, int bits, int group, *, Tensor(a!) out)
//   k_codes, v_codes uint8 with Hkv*T*D*bits/8 elements (bits 4 or 2); the scales and zeros fp16 with Hkv*T*D/group.
#include <executorch/extension/kernel_util/make_boxed_from_unboxed_functor.h>
#include <executorch/runtime/kernel/kernel_includes.h>

#include <cstring>
#include <vector>

#include "int8_sdpa_core.h"

namespace edgekv_native {

using executorch::aten::ScalarType;
using executorch::aten::Tensor;
using executorch::runtime::KernelRuntimeContext;

namespace {

// the first n scales of a tensor as fp32 (fp16 converted, fp32 copied); false for another dtype
bool scales_f32(const Tensor& s, int64_t n, std::vector<float>& dst) {
  dst.resize(n);
  if (s.scalar_type() == ScalarType::Float) {
    std::memcpy(dst.data(), s.const_data_ptr<float>(), n * sizeof(float));
    return true;
  }
  if (s.scalar_type() == ScalarType::Half) {
    const uint16_t* p = reinterpret_cast<const uint16_t*>(s.const_data_ptr());
    for (int64_t i = 0; i < n; ++i) dst[i] = half_to_float(p[i]);
    return true;
  }
  return false;
}

// The checks both kernels share: q fp32 [Hkv, C, G, D]; k and v of the cache's dtype with Hkv * T * D elements; the
// call's tokens inside the cache's T slots; out fp32, resized to q's shape. Sets t; false (the error reported on ctx)
// when a check fails.
bool checked(KernelRuntimeContext& ctx, const Tensor& q, const Tensor& k, const Tensor& v, ScalarType cache,
             int64_t start_pos, Tensor& out, int64_t& t, int64_t per_byte = 1) {
  ET_KERNEL_CHECK_MSG(ctx, q.dim() == 4 && q.scalar_type() == ScalarType::Float, InvalidArgument, false,
                      "q must be fp32 [Hkv, C, G, D]");
  const int64_t hkv = q.size(0), c = q.size(1), d = q.size(3);
  const int64_t row = per_byte > 0 ? d / per_byte : 0;  // stored elements a slot holds per head
  ET_KERNEL_CHECK_MSG(ctx, k.scalar_type() == cache && v.scalar_type() == cache && k.numel() == v.numel() &&
                      hkv * row > 0 && row * per_byte == d && k.numel() % (hkv * row) == 0,
                      InvalidArgument, false,
                      "k, v must be the cache's dtype (int8 codes, fp16, packed codes) with Hkv * T * D elements");
  t = k.numel() / (hkv * row);
  ET_KERNEL_CHECK_MSG(ctx, start_pos >= 0 && start_pos + c <= t, InvalidArgument, false,
                      "start_pos %lld + %lld tokens past the cache's %lld slots", (long long)start_pos,
                      (long long)c, (long long)t);
  ET_KERNEL_CHECK_MSG(ctx, out.scalar_type() == ScalarType::Float, InvalidArgument, false, "out must be fp32");
  ET_KERNEL_CHECK(ctx, executorch::runtime::resize_tensor(out, q.sizes()) == executorch::runtime::Error::Ok,
                  InvalidArgument, false);
  return true;
}

}  // namespace

Tensor& int8_sdpa_out(KernelRuntimeContext& ctx, const Tensor& q, const Tensor& k, const Tensor& v,
                      const Tensor& ks, const Tensor& vs, int64_t start_pos, double scale, bool per_channel,
                      Tensor& out) {
  int64_t t = 0;
  if (!checked(ctx, q, k, v, ScalarType::Char, start_pos, out, t)) return out;
  const int64_t hkv = q.size(0), c = q.size(1), g = q.size(2), d = q.size(3);
  const int64_t ns = per_channel ? hkv * d : hkv * t;
  ET_KERNEL_CHECK_MSG(ctx, ks.numel() == ns && vs.numel() == ns, InvalidArgument, out,
                      "k_scale, v_scale must have %lld elements", (long long)ns);
  std::vector<float> kscale, vscale;
  ET_KERNEL_CHECK_MSG(ctx, scales_f32(ks, ns, kscale) && scales_f32(vs, ns, vscale), InvalidArgument, out,
                      "scales must be fp16 or fp32");
  int8_sdpa(q.const_data_ptr<float>(), k.const_data_ptr<int8_t>(), v.const_data_ptr<int8_t>(),
            per_channel ? nullptr : kscale.data(), per_channel ? nullptr : vscale.data(),
            per_channel ? kscale.data() : nullptr, per_channel ? vscale.data() : nullptr, hkv, c, g, d, t, start_pos,
            static_cast<float>(scale), out.mutable_data_ptr<float>());
  return out;
}

Tensor& fp16_sdpa_out(KernelRuntimeContext& ctx, const Tensor& q, const Tensor& k, const Tensor& v, int64_t start_pos,
                      double scale, Tensor& out) {
  int64_t t = 0;
  if (!checked(ctx, q, k, v, ScalarType::Half, start_pos, out, t)) return out;
  fp16_sdpa(q.const_data_ptr<float>(), reinterpret_cast<const uint16_t*>(k.const_data_ptr()),
            reinterpret_cast<const uint16_t*>(v.const_data_ptr()), q.size(0), q.size(1), q.size(2), q.size(3), t,
            start_pos, static_cast<float>(scale), out.mutable_data_ptr<float>());
  return out;
}

Tensor& packed_sdpa_out(KernelRuntimeContext& ctx, const Tensor& q, const Tensor& k, const Tensor& v,
                        const Tensor& ks, const Tensor& kz, const Tensor& vs, const Tensor& vz, int64_t start_pos,
                        double scale, int64_t bits, int64_t group, Tensor& out) {
  ET_KERNEL_CHECK_MSG(ctx, bits == 4 || bits == 2, InvalidArgument, out, "bits must be 4 or 2");
  int64_t t = 0;
  if (!checked(ctx, q, k, v, ScalarType::Byte, start_pos, out, t, 8 / bits)) return out;
  const int64_t hkv = q.size(0), d = q.size(3);
  ET_KERNEL_CHECK_MSG(ctx, group > 0 && d % group == 0 && group % (8 / bits) == 0, InvalidArgument, out,
                      "group %lld must divide the head size %lld", (long long)group, (long long)d);
  const int64_t ns = hkv * t * (d / group);
  for (const Tensor* x : {&ks, &kz, &vs, &vz})
    ET_KERNEL_CHECK_MSG(ctx, x->scalar_type() == ScalarType::Half && x->numel() == ns, InvalidArgument, out,
                        "scales and zeros must be fp16 with %lld elements", (long long)ns);
  auto bits16 = [](const Tensor& x) { return reinterpret_cast<const uint16_t*>(x.const_data_ptr()); };
  const Packed pk{k.const_data_ptr<uint8_t>(), bits16(ks), bits16(kz), bits, group};
  const Packed pv{v.const_data_ptr<uint8_t>(), bits16(vs), bits16(vz), bits, group};
  packed_sdpa(q.const_data_ptr<float>(), pk, pv, hkv, q.size(1), q.size(2), d, t, start_pos,
              static_cast<float>(scale), out.mutable_data_ptr<float>());
  return out;
}

}  // namespace edgekv_native

EXECUTORCH_LIBRARY(edgekv, "int8_sdpa.out", edgekv_native::int8_sdpa_out);
EXECUTORCH_LIBRARY(edgekv, "fp16_sdpa.out", edgekv_native::fp16_sdpa_out);
EXECUTORCH_LIBRARY(edgekv, "packed_sdpa.out", edgekv_native::packed_sdpa_out);

// For tests and benchmarks through ctypes: the same core on raw fp32 buffers (scales already fp32).
extern "C" {
int edgekv_int8_sdpa_simd() { return edgekv_native::int8_sdpa_simd(); }
void edgekv_int8_sdpa_f32(const float* q, const int8_t* k, const int8_t* v, const float* ks, const float* vs,
                          int per_channel, int64_t hkv, int64_t c, int64_t g, int64_t d, int64_t t, int64_t start,
                          float scale, float* out) {
  edgekv_native::int8_sdpa(q, k, v, per_channel ? nullptr : ks, per_channel ? nullptr : vs, per_channel ? ks : nullptr,
                           per_channel ? vs : nullptr, hkv, c, g, d, t, start, scale, out);
}
void edgekv_fp16_sdpa_f32(const float* q, const uint16_t* k, const uint16_t* v, int64_t hkv, int64_t c, int64_t g,
                          int64_t d, int64_t t, int64_t start, float scale, float* out) {
  edgekv_native::fp16_sdpa(q, k, v, hkv, c, g, d, t, start, scale, out);
}
void edgekv_packed_sdpa_f32(const float* q, const uint8_t* k, const uint8_t* v, const uint16_t* ks,
                            const uint16_t* kz, const uint16_t* vs, const uint16_t* vz, int64_t bits, int64_t group,
                            int64_t hkv, int64_t c, int64_t g, int64_t d, int64_t t, int64_t start, float scale,
                            float* out) {
  const edgekv_native::Packed pk{k, ks, kz, bits, group}, pv{v, vs, vz, bits, group};
  edgekv_native::packed_sdpa(q, pk, pv, hkv, c, g, d, t, start, scale, out);
}
}
