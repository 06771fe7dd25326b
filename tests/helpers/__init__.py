"""What the tests share: tiny runs and models, a NumPy reference of the model, a local GCS,
fault injection, and the scripts that tests start as separate processes. Test files
import from here, never from each other."""
