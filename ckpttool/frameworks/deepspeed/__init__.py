"""DeepSpeed ZeRO: its files and checks, the fp32 master weights, the universal checkpoint, its lines in show."""
