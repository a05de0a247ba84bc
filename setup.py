"""Build: the Cython tree scheduler (scheduler/*.pyx -> swiftspec_mpi._tree), the CPU decode GEMM
(swiftspec_mpi/packed/_cpu_gemm.pyx + packed/csrc/*.h -> swiftspec_mpi.packed._cpu_gemm) and the CUDA
sources in cuda/ shipped as package data (swiftspec_mpi.cuda). Metadata lives in setup.cfg."""
from Cython.Build import cythonize
from setuptools import Extension, find_packages, setup

extensions = cythonize(
    [Extension("swiftspec_mpi._tree", ["scheduler/tree.pyx"], extra_compile_args=["-O3"]),
     # the CPU decode GEMM (AVX2 + FMA by function attribute, checked at run time; OpenMP threads)
     Extension("swiftspec_mpi.packed._cpu_gemm", ["swiftspec_mpi/packed/_cpu_gemm.pyx"],
               include_dirs=["swiftspec_mpi/packed/csrc"],
               depends=["swiftspec_mpi/packed/csrc/gemm_avx2.h",
                        "swiftspec_mpi/packed/csrc/gemm_q.h",
                        "swiftspec_mpi/packed/csrc/layer_ops.h"], extra_compile_args=["-O3", "-fopenmp"],
               extra_link_args=["-fopenmp"])],
    compiler_directives={"language_level": 3, "boundscheck": False, "wraparound": False,
                         "cdivision": True, "initializedcheck": False},
)

setup(
    ext_modules=extensions,
    package_dir={"swiftspec_mpi": "swiftspec_mpi", "swiftspec_mpi.cuda": "cuda"},
    packages=find_packages(include=["swiftspec_mpi", "swiftspec_mpi.*"]) + ["swiftspec_mpi.cuda"],
    package_data={"swiftspec_mpi.cuda": ["*.cu", "*.cuh", "*.h"], "swiftspec_mpi": ["data/*"],
                  "swiftspec_mpi.packed": ["csrc/*.h"]},
)
