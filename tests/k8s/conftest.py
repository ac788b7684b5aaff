from tests.k8s.fixtures import emulator, k8s_api, kubelet

__all__ = ["emulator", "k8s_api", "kubelet"]
