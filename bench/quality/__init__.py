"""Quality benchmarks: perplexity of every checkpoint format against its reference, RTN vs AWQ, the memory of
quantizing, the GGUF run 4-bit, and whether vLLM loads what lightinfer writes."""
