//! Compiles the C++ half of the PyTorch entry points (`shim/torch_shim.cpp`) into the shared
//! library; it needs a C++ compiler (`c++`, or `CXX`) and links the C++ runtime (libstdc++),
//! which every PyTorch process has loaded already.

fn main() {
    println!("cargo:rerun-if-changed=shim/torch_shim.cpp");
    cc::Build::new()
        .cpp(true)
        .std("c++17")
        .file("shim/torch_shim.cpp")
        .warnings(true)
        .compile("cachalot_torch_shim");
}
