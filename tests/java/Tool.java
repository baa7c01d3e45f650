// A payment tool in Java, written as tools are: Stripe's PaymentIntents with java.net.http's
// default HttpClient and the secret key from STRIPE_API_KEY. Nothing here names the proxy or
// its CA: the worker's environment does (JAVA_TOOL_OPTIONS; tests/it/sdk_matrix.rs). One
// invocation is one run of the tool.
//
//     java Tool.java INVOICE AMOUNT
//
// Prints one JSON line: {"status", "id", "replayed"}, or {"error"}.
import java.net.URI;
import java.net.http.HttpClient;
import java.net.http.HttpRequest;
import java.net.http.HttpResponse;
import java.util.regex.Matcher;
import java.util.regex.Pattern;

public class Tool {
    public static void main(String[] args) {
        String form = "amount=" + args[1] + "&currency=usd&payment_method=pm_card_visa&confirm=true"
                + "&metadata%5Binvoice_id%5D=" + args[0];
        HttpRequest request = HttpRequest.newBuilder(URI.create("https://api.stripe.com/v1/payment_intents"))
                .header("Authorization", "Bearer " + System.getenv("STRIPE_API_KEY"))
                .header("Content-Type", "application/x-www-form-urlencoded")
                .POST(HttpRequest.BodyPublishers.ofString(form))
                .build();
        try {
            HttpResponse<String> r = HttpClient.newHttpClient().send(request, HttpResponse.BodyHandlers.ofString());
            Matcher id = Pattern.compile("\"id\"\\s*:\\s*\"([^\"]+)\"").matcher(r.body());
            System.out.println("{\"status\":" + r.statusCode()
                    + ",\"id\":\"" + (id.find() ? id.group(1) : "") + "\""
                    + ",\"replayed\":\"" + r.headers().firstValue("idempotent-replayed").orElse("") + "\"}");
        } catch (Exception e) {
            String message = String.valueOf(e.getMessage()).replace("\\", "\\\\").replace("\"", "'");
            System.out.println("{\"error\":\"" + e.getClass().getName() + "\",\"message\":\"" + message + "\"}");
        }
    }
}
