"""swiftspec-mpi: MPI-native, ultra-low-latency speculative decoding (the SwiftSpec method).

Data flows one way: cli -> config/topology -> engine loops -> model / scheduler / kernels -> trace.
"""
__version__ = "0.1.0"
