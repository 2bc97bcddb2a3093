"""What the benchmarks share: where results go and what a run records about the machine (``results``,
``machine``), server processes and the load client (``servers``, ``serve_process``, ``client``), /proc
readings (``procfs``), and the peers of the CPU serving benchmark (``peer_install``, ``peer_report``)."""
