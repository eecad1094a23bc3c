"""One Envoy stream is one client request: its phases, bodies, plan and legs, in call order."""
