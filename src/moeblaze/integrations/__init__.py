"""Integrations of moeblaze with other libraries (import each submodule explicitly; each needs its library)."""
