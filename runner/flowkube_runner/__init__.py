"""The in-pod runner: executes one crewAI Flow run."""
