"""Benchmarks: each module is a program with `main()` that prints a table and can be rerun
(`python -m benchmarks.<name> --help`). Their figures, with command, machine and date, are in
docs/benchmarks.md. Nothing in the engine, the protocol, the chain, scoring or the neurons imports them."""
