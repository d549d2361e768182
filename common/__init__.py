"""The bottom of the project: helpers every package may use, importing no other project
package and no torch (atomic file writes, sha256, the config-schema machinery, constants)."""
