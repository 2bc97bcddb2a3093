"""Serving benchmarks: lightinfer against llama.cpp and vLLM, HTTP and offline throughput, start-up, an idle server,
end-to-end GPU runs and the memory table."""
