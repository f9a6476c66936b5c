"""Process placement: rollout servers and trainer ranks as Ray actors (`armor ray-train`)."""
