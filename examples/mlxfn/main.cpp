// detect: loads a Deformable DETR .mlxfn file exported with --postprocess, runs it on one image given
// as raw float32 and prints its detections, one a line: label score x0 y0 x1 y1 (pixels).
//
//   detect MODEL.mlxfn IMAGE.f32 HEIGHT WIDTH [--threshold T] [--original-size H W]
//
// IMAGE.f32: HEIGHT x WIDTH x 3 float32, RGB, already resized and normalised as the model's
// evaluation does ((pixel / 255 - mean) / std, ImageNet's mean and std; README.md shows how). It is
// placed at the top left of the file's canvas, the rest padding, as pad_to_canvas does in Python.
// Boxes are in pixels of --original-size (default HEIGHT x WIDTH). Errors: one line, exit status 1.
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <stdexcept>
#include <string>
#include <vector>

#include "mlx/mlx.h"

namespace mx = mlx::core;

struct Options {
  std::string model, image;
  int height = 0, width = 0, original_height = 0, original_width = 0;
  float threshold = 0.0f;
};

int positive(const std::string& text, const char* what) {
  size_t used = 0;
  int value = 0;
  try {
    value = std::stoi(text, &used);
  } catch (const std::exception&) {
  }
  if (used != text.size() || value < 1) {
    throw std::runtime_error(std::string(what) + " " + text + ": expected a positive integer");
  }
  return value;
}

Options parse(int argc, char** argv) {
  Options o;
  std::vector<std::string> positional;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--threshold" && i + 1 < argc) {
      o.threshold = std::stof(argv[++i]);
    } else if (arg == "--original-size" && i + 2 < argc) {
      o.original_height = positive(argv[++i], "--original-size height");
      o.original_width = positive(argv[++i], "--original-size width");
    } else {
      positional.push_back(arg);
    }
  }
  if (positional.size() != 4) {
    throw std::runtime_error(
        "usage: detect MODEL.mlxfn IMAGE.f32 HEIGHT WIDTH [--threshold T] [--original-size H W]");
  }
  o.model = positional[0];
  o.image = positional[1];
  o.height = positive(positional[2], "HEIGHT");
  o.width = positive(positional[3], "WIDTH");
  if (o.original_height == 0) {
    o.original_height = o.height;
    o.original_width = o.width;
  }
  return o;
}

// The integer after "key": [ in the file's JSON metadata (written by deformable_detr/deploy/mlxfn.py).
int metadata_int(const std::string& metadata, const std::string& key, int index, const std::string& file) {
  size_t at = metadata.find("\"" + key + "\":");
  if (at == std::string::npos) {
    throw std::runtime_error(file + ": its metadata has no " + key + " (not written by export --to mlx?)");
  }
  at = metadata.find_first_of("0123456789", at);
  for (int i = 0; i < index; ++i) {
    at = metadata.find_first_of("0123456789", metadata.find_first_not_of("0123456789", at));
  }
  return std::stoi(metadata.substr(at));
}

std::vector<float> read_image(const Options& o) {
  std::ifstream in(o.image, std::ios::binary | std::ios::ate);
  if (!in) {
    throw std::runtime_error(o.image + ": cannot be read");
  }
  const size_t expected = size_t(o.height) * o.width * 3 * sizeof(float);
  if (size_t(in.tellg()) != expected) {
    throw std::runtime_error(o.image + ": " + std::to_string(in.tellg()) + " bytes; " + std::to_string(o.height) +
                             " x " + std::to_string(o.width) + " x 3 float32 is " + std::to_string(expected));
  }
  std::vector<float> pixels(size_t(o.height) * o.width * 3);
  in.seekg(0);
  in.read(reinterpret_cast<char*>(pixels.data()), std::streamsize(expected));
  return pixels;
}

int run(const Options& o) {
  const mx::ImportedFunction detector = mx::import_function(o.model);
  const std::string& metadata = detector.metadata();
  if (metadata.find("\"target_sizes\"") == std::string::npos) {
    throw std::runtime_error(o.model + ": takes no target_sizes; export it with --postprocess");
  }
  const int canvas_h = metadata_int(metadata, "canvas", 0, o.model);
  const int canvas_w = metadata_int(metadata, "canvas", 1, o.model);
  const int batch = metadata_int(metadata, "batch", 0, o.model);
  if (o.height > canvas_h || o.width > canvas_w) {
    throw std::runtime_error(o.image + ": " + std::to_string(o.height) + " x " + std::to_string(o.width) +
                             " does not fit the " + std::to_string(canvas_h) + " x " + std::to_string(canvas_w) +
                             " canvas " + o.model + " was exported for; resize it or export with a larger --size");
  }
  const std::vector<float> image = read_image(o);
  // Every image of the batch is this one (a file exported for N images takes N).
  std::vector<float> values(size_t(batch) * 3 * canvas_h * canvas_w, 0.0f);
  std::vector<int64_t> mask(size_t(batch) * canvas_h * canvas_w, 0);
  for (int n = 0; n < batch; ++n) {
    for (int y = 0; y < o.height; ++y) {
      for (int x = 0; x < o.width; ++x) {
        for (int c = 0; c < 3; ++c) {  // (H, W, 3) -> (N, 3, H, W)
          values[((size_t(n) * 3 + c) * canvas_h + y) * canvas_w + x] = image[(size_t(y) * o.width + x) * 3 + c];
        }
        mask[(size_t(n) * canvas_h + y) * canvas_w + x] = 1;
      }
    }
  }
  std::vector<int64_t> sizes;
  for (int n = 0; n < batch; ++n) {
    sizes.insert(sizes.end(), {int64_t(o.original_height), int64_t(o.original_width)});
  }
  const auto outputs = detector(mx::Kwargs{
      {"pixel_values", mx::array(values.begin(), {batch, 3, canvas_h, canvas_w}, mx::float32)},
      {"pixel_mask", mx::array(mask.begin(), {batch, canvas_h, canvas_w}, mx::int64)},
      {"target_sizes", mx::array(sizes.begin(), {batch, 2}, mx::int64)},
  });
  mx::eval(outputs);
  const float* scores = outputs[0].data<float>();
  const int64_t* labels = outputs[1].data<int64_t>();
  const float* boxes = outputs[2].data<float>();
  for (int k = 0; k < outputs[0].shape(1); ++k) {  // the first image's, best first
    if (scores[k] >= o.threshold) {
      std::printf("%lld %.7g %.7g %.7g %.7g %.7g\n", static_cast<long long>(labels[k]), scores[k], boxes[4 * k],
                  boxes[4 * k + 1], boxes[4 * k + 2], boxes[4 * k + 3]);
    }
  }
  return 0;
}

int main(int argc, char** argv) {
  try {
    return run(parse(argc, argv));
  } catch (const std::exception& error) {
    std::string line = error.what();
    std::cerr << "error: " << line.substr(0, line.find('\n')) << std::endl;
    return 1;
  }
}
