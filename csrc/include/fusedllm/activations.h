// Gated-MLP activations and their derivatives, shared by the CPU kernels
// (scalar and ATen vector lanes) and the CUDA kernels. `V` is float/double or
// an ATen vector of them; `Math` supplies exp and tanh for V (ScalarMath below
// for plain numbers, with the log the CUDA cross-entropy takes too; a vector
// policy in the CPU kernels).
#pragma once

#include <cmath>

#include "fusedllm/macros.h"

namespace fusedllm::act {

enum class Activation : int {
  kSilu = 0,      // x * sigmoid(x)            (SwiGLU: Llama, Mistral, Qwen)
  kGeluTanh = 1,  // tanh approximation of GELU (GeGLU: Gemma)
};

struct ScalarMath {
  FUSEDLLM_HOST_DEVICE static float exp(float x) { return ::expf(x); }
  FUSEDLLM_HOST_DEVICE static double exp(double x) { return ::exp(x); }
  FUSEDLLM_HOST_DEVICE static float tanh(float x) { return ::tanhf(x); }
  FUSEDLLM_HOST_DEVICE static double tanh(double x) { return ::tanh(x); }
  FUSEDLLM_HOST_DEVICE static float log(float x) { return ::logf(x); }
  FUSEDLLM_HOST_DEVICE static double log(double x) { return ::log(x); }
};

// Soft-capping (Gemma 2's final logits and attention scores): s = cap *
// tanh(z / cap) from the raw z, and ds/dz = 1 - (s / cap)^2 from s.
template <typename Math, typename V>
FUSEDLLM_HOST_DEVICE V capped(V z, V cap) {
  return cap * Math::tanh(z / cap);
}

template <typename V>
FUSEDLLM_HOST_DEVICE V cap_slope(V s, V inv_cap) {
  const V r = s * inv_cap;
  return V(1) - r * r;
}

// sqrt(2 / pi) and the cubic coefficient of the tanh approximation.
constexpr double kGeluC0 = 0.7978845608028654;
constexpr double kGeluC1 = 0.044715;

template <typename Math, typename V>
FUSEDLLM_HOST_DEVICE V sigmoid(V x) {
  return V(1) / (V(1) + Math::exp(V(0) - x));
}

// act(x) for the forward pass.
template <Activation A, typename Math, typename V>
FUSEDLLM_HOST_DEVICE V activate(V x) {
  if constexpr (A == Activation::kSilu) {
    return x * sigmoid<Math>(x);
  } else {
    const V t = Math::tanh(V(kGeluC0) * (x + V(kGeluC1) * x * x * x));
    return V(0.5) * x * (V(1) + t);
  }
}

// act(x) and act'(x) together (backward needs both and they share work).
template <Activation A, typename Math, typename V>
FUSEDLLM_HOST_DEVICE void activate_with_grad(V x, V& value, V& grad) {
  if constexpr (A == Activation::kSilu) {
    const V s = sigmoid<Math>(x);
    value = x * s;
    grad = s * (V(1) + x * (V(1) - s));
  } else {
    const V x2 = x * x;
    const V t = Math::tanh(V(kGeluC0) * (x + V(kGeluC1) * x2 * x));
    value = V(0.5) * x * (V(1) + t);
    grad = V(0.5) * (V(1) + t) +
           V(0.5) * x * (V(1) - t * t) * V(kGeluC0) * (V(1) + V(3 * kGeluC1) * x2);
  }
}

// h = act(gate) * up, and the gradients of sum(dh * h).
template <Activation A, typename Math, typename V>
FUSEDLLM_HOST_DEVICE V gated(V gate, V up) {
  return activate<A, Math>(gate) * up;
}

template <Activation A, typename Math, typename V>
FUSEDLLM_HOST_DEVICE void gated_grad(V dh, V gate, V up, V& grad_gate, V& grad_up) {
  V value, slope;
  activate_with_grad<A, Math>(gate, value, slope);
  grad_gate = dh * up * slope;
  grad_up = dh * value;
}

// gpt-oss's clamped SwiGLU: g = min(gate, limit), u = clamp(up, -limit, limit),
// h = (u + 1) * g * sigmoid(alpha * g). A NaN stays NaN, as torch's clamp.
template <typename Math, typename V>
FUSEDLLM_HOST_DEVICE V gpt_oss_gated(V gate, V up, V alpha, V limit) {
  const V g = gate > limit ? limit : gate;
  const V u = up > limit ? limit : (up < -limit ? -limit : up);
  return (u + V(1)) * g * sigmoid<Math>(alpha * g);
}

// Its gradients from dh, as autograd of that formula gives them: a clamp
// passes the gradient where its input lies within the bounds (bounds
// included) and zero elsewhere (NaN included).
template <typename Math, typename V>
FUSEDLLM_HOST_DEVICE void gpt_oss_gated_grad(V dh, V gate, V up, V alpha, V limit, V& grad_gate,
                                             V& grad_up) {
  const bool gate_free = gate <= limit, up_free = up >= -limit && up <= limit;
  const V g = gate > limit ? limit : gate;
  const V u = up > limit ? limit : (up < -limit ? -limit : up);
  const V s = sigmoid<Math>(alpha * g);
  grad_gate = gate_free ? dh * (u + V(1)) * s * (V(1) + alpha * g * (V(1) - s)) : V(0);
  grad_up = up_free ? dh * g * s : V(0);
}

}  // namespace fusedllm::act
