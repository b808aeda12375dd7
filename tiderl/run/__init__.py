"""The main job: rank processes with roles, the control plane and the local launcher (`tiderl run`)."""
