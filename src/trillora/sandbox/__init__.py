"""The jail that runs the policy's programs: namespaces, seccomp, resource limits, no network."""
