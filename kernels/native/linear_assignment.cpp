// linear_assignment as an MLX Primitive: Hungarian matching of each image's targets to its queries,
// evaluated on MLX's CPU stream, so that a training step's loss needs no host synchronisation.

#include <cmath>
#include <limits>
#include <numeric>
#include <stdexcept>
#include <string>

#include "mlx/ops.h"
#include "mlx/primitives.h"

#include "dispatch.h"
#include "ops.h"

namespace kernels {

namespace mx = mlx::core;

namespace {

// Minimum-cost assignment of every row to a distinct column (rows <= columns): shortest augmenting
// paths with row and column potentials (Kuhn-Munkres in O(rows^2 columns)). cost(r, c) reads the
// matrix; returns the column of each row. Non-finite costs count as a huge finite cost, so that a
// diverged model still gets a matching (its loss is then not finite, and training stops on that).
template <typename Cost>
std::vector<int> assign(int rows, int columns, Cost cost) {
  constexpr double huge = 1e30;
  const double inf = std::numeric_limits<double>::infinity();
  std::vector<double> u(rows + 1, 0.0), v(columns + 1, 0.0), slack(columns + 1);
  std::vector<int> row_of(columns + 1, 0), previous(columns + 1, 0);  // 1-based; column 0 is the root
  std::vector<char> visited(columns + 1);
  for (int r = 1; r <= rows; ++r) {
    row_of[0] = r;
    int column = 0;
    std::fill(slack.begin(), slack.end(), inf);
    std::fill(visited.begin(), visited.end(), 0);
    do {
      visited[column] = 1;
      const int row = row_of[column];
      double delta = inf;
      int next = 0;
      for (int c = 1; c <= columns; ++c) {
        if (visited[c]) {
          continue;
        }
        double value = double(cost(row - 1, c - 1));
        value = std::isfinite(value) ? value : huge;
        const double reduced = value - u[row] - v[c];
        if (reduced < slack[c]) {
          slack[c] = reduced;
          previous[c] = column;
        }
        if (slack[c] < delta) {
          delta = slack[c];
          next = c;
        }
      }
      for (int c = 0; c <= columns; ++c) {
        if (visited[c]) {
          u[row_of[c]] += delta;
          v[c] -= delta;
        } else {
          slack[c] -= delta;
        }
      }
      column = next;
    } while (row_of[column] != 0);
    do {  // flip the augmenting path back to the root
      const int before = previous[column];
      row_of[column] = row_of[before];
      column = before;
    } while (column != 0);
  }
  std::vector<int> column_of(rows, -1);
  for (int c = 1; c <= columns; ++c) {
    if (row_of[c] != 0) {
      column_of[row_of[c] - 1] = c - 1;
    }
  }
  return column_of;
}

class LinearAssignment : public mx::UnaryPrimitive {
 public:
  LinearAssignment(mx::Stream stream, std::vector<int> sizes) : mx::UnaryPrimitive(stream), sizes_(std::move(sizes)) {}

  void eval_cpu(const std::vector<array>& inputs, array& out) override {
    auto& encoder = kernels_native::prepared_encoder(stream(), inputs, {out});
    encoder.dispatch([cost = inputs[0], out_ptr = out.data<int32_t>(), sizes = sizes_]() {
      if (!cost.flags().row_contiguous) {
        throw std::runtime_error("linear_assignment: the cost is not row-contiguous");
      }
      const int queries = cost.shape(1);
      const int64_t targets = cost.shape(2);
      const float* data = cost.data<float>();
      for (size_t b = 0, start = 0; b < sizes.size(); start += sizes[b], ++b) {
        const float* image = data + int64_t(b) * queries * targets;
        // rows: this image's targets; columns: its queries
        const auto query_of = assign(sizes[b], queries, [&](int t, int q) {
          return image[int64_t(q) * targets + int64_t(start) + t];
        });
        std::copy(query_of.begin(), query_of.end(), out_ptr + start);
      }
    });
  }
  void eval_gpu(const std::vector<array>&, array&) override {
    throw std::runtime_error("LinearAssignment runs on the CPU only");
  }
  std::vector<array> vjp(const std::vector<array>& primals, const std::vector<array>&, const std::vector<int>&,
                         const std::vector<array>&) override {
    return {mx::zeros_like(primals[0], stream())};  // an assignment is piecewise constant in its costs
  }
  const char* name() const override { return "LinearAssignment"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    return sizes_ == static_cast<const LinearAssignment&>(other).sizes_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<array>&) override {
    return {{std::accumulate(sizes_.begin(), sizes_.end(), 0)}};
  }

 private:
  std::vector<int> sizes_;
};

}  // namespace

array linear_assignment(const array& cost, const std::vector<int>& sizes) {
  if (cost.ndim() != 3 || size_t(cost.shape(0)) != sizes.size()) {
    throw std::invalid_argument("linear_assignment: cost must be (B, Q, T) with one size per image");
  }
  const int total = std::accumulate(sizes.begin(), sizes.end(), 0);
  if (total != cost.shape(2)) {
    throw std::invalid_argument("linear_assignment: the sizes must add up to the cost's last dimension");
  }
  for (int size : sizes) {
    if (size < 0 || size > cost.shape(1)) {
      throw std::invalid_argument("linear_assignment: an image has more targets (" + std::to_string(size) +
                                  ") than queries (" + std::to_string(cost.shape(1)) + ")");
    }
  }
  const auto stream = mx::default_stream(mx::Device::cpu);
  const auto prepared = mx::contiguous(mx::stop_gradient(mx::astype(cost, mx::float32, stream), stream), false, stream);
  return array({total}, mx::int32, std::make_shared<LinearAssignment>(stream, sizes), {prepared});
}

}  // namespace kernels
