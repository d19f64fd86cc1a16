"""The Triton kernels. Each submodule imports Triton; this package itself does not, so the constants that the
PyTorch paths share with the kernels live here and a CPU install without Triton can read them."""

# token rounding's modes (moeblaze.token_rounding): the kernels' MODE constexpr is a mode's index here
ROUNDING_MODES = ("nr", "up", "down", "sr")
