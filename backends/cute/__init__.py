"""The CuTe DSL backend (SM90/SM100). No operator has a CuTe kernel in this version."""
