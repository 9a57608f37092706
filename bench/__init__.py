"""ftjob's benchmarks: each suite runs ftjob and the alternative a user would pick, side by side.

python -m bench                      # the CPU suite (the GPU parts run where CUDA is)
python -m bench --suite checkpoints --quick
"""
