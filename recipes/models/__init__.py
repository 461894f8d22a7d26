"""LightningModules of the recipes: ResNet (images), BERT (text), GNN (graphs), CharLM
(character-level language model), HFCausalLM (Hugging Face GPT-2 and Llama)."""

from recipes.models.bert import BertClassifier
from recipes.models.causal_lm import HFCausalLM
from recipes.models.charlm import CharLM
from recipes.models.classifier import Classifier
from recipes.models.gnn import GNNClassifier
from recipes.models.resnet import ResNet, ResNetClassifier

__all__ = [
    "BertClassifier",
    "CharLM",
    "Classifier",
    "GNNClassifier",
    "HFCausalLM",
    "ResNet",
    "ResNetClassifier",
]
