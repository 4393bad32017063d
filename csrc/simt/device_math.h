// Device math functions that have no host twin, as the emulated build computes
// them. __expf is ex2.approx(x * log2(e)) on the GPU: the rounding of the
// product is emulated, ex2.approx itself is taken as exact (the GPU's is within
// 2 ulp), so results agree with a GPU's to about that.
#pragma once

#include <cmath>

inline float __expf(float x) { return std::exp2(x * 1.44269504088896341f); }
inline float __logf(float x) { return std::log2(x) * 0.693147180559945309f; }
inline float __fdividef(float a, float b) { return a / b; }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline double rsqrt(double x) { return 1.0 / std::sqrt(x); }
