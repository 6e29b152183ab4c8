// The server's compiled step run with Python's GIL released: torch's own AOTInductor bindings hold the GIL for
// the whole call, so the HTTP event loop could not run while a step computed (compiled_step.load_released).
#include <torch/csrc/inductor/aoti_runner/model_container_runner_cpu.h>
#include <torch/extension.h>

struct Step {
  torch::inductor::AOTIModelContainerRunnerCpu runner;  // the package's model .so (its .json beside it: the custom ops)

  explicit Step(const std::string& so_path) : runner(so_path, 1) {}

  std::unordered_map<std::string, std::string> fqns() const { return runner.getConstantNamesToOriginalFQNs(); }

  // The model's weights and buffers as the package's constants, user-managed: read in place, never copied.
  void constants(std::unordered_map<std::string, at::Tensor> tensors) { runner.update_constant_buffer(tensors, false, true, true); }

  std::vector<at::Tensor> boxed_run(const std::vector<at::Tensor>& inputs) {
    py::gil_scoped_release released;
    return runner.run(inputs);
  }
};

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<Step>(m, "Step")
      .def(py::init<const std::string&>())
      .def("fqns", &Step::fqns)
      .def("constants", &Step::constants)
      .def("boxed_run", &Step::boxed_run);
}
