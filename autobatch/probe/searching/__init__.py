"""Search strategies over real trials: halving, binary, and the predictive search along the memory line."""
